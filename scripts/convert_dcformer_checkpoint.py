#!/usr/bin/env python3
"""Convert an official DCFormer / DCPythia PyTorch checkpoint into the safetensors file that the
weight loader of examples/dcformer_attention (load_weights.hpp) reads.

    convert_dcformer_checkpoint.py INPUT OUTPUT.safetensors [--dtype keep|float32|bfloat16|float16]
                                   [--layers 0-3,8] [--config config.json]

INPUT is a pytorch_model.bin, a pytorch_model.bin.index.json, or a directory holding either
one (a sharded checkpoint: the index and its shards). The model config is config.json beside
INPUT (or --config). Only the attention parameters are written, under the official names, for
each layer i and E = dim, H = n_head, Hk = n_local_heads, D = dim / n_head, K = 4H:

    checkpoint (official PyTorch)            output                           shape
    layers.i.attention.wqkv.weight        -> layers.i.attention.wqkv.weight   ((H + 2Hk)·D, E)
      or wq.weight, wk.weight, wv.weight     rows concatenated (q, k, v), as the official load
         (H·D, E), (Hk·D, E), (Hk·D, E)      hook does for older checkpoints
    layers.i.attention.wo.weight          -> same name                        (E, H·D)
    layers.i.attention.dyn_w_proj.dw1     -> same name (use_dcmha only)       (E, 1, 4, K)
    layers.i.attention.dyn_w_proj.qkw     -> same name (use_dcmha only)       (1, 4, K, 2R, H)
    layers.i.attention.dyn_w_proj.dd      -> same name (use_dcmha only)       (E, 1, 4H)
    layers.i.attention.q_norm.scale,
    layers.i.attention.k_norm.scale       -> same names (use_qk_norm only)    (D)

R = H // (H // 2) is the official rank (2 for the published models). Not written: every other
tensor, among them the merged copies dyn_w_proj.dw_m / qkw_m, the identity buffers
dyn_w_proj.pre_proj.w / post_proj.w (static W is off in the published models) and the
dyn_w_proj tensors when use_dcmha is off. A prefix before "layers." (a state dict saved from a
wrapping module) is dropped, and a training checkpoint's nested "model" / "state_dict" is used.

Every wanted tensor is checked before the output is written: present, a floating-point dtype,
the official shape. A failure names the tensor and exits with status 1, e.g.

    convert_dcformer_checkpoint.py: layers.0.attention.wqkv.weight: expected shape (96, 32),
    got (95, 32)

The output stores the dtypes the loader reads (F16, BF16, F32, F64); --dtype converts (torch's
round to nearest even when narrowing). Its __metadata__ holds the model config as JSON
("dcformer_config") and the converted layers ("dcformer_layers"); the loader needs neither.
Needs only torch: the safetensors format is written here.
"""
import argparse
import json
import os
import re
import struct
import sys
from dataclasses import dataclass

import torch

PROG = "convert_dcformer_checkpoint.py"
SINGLE_FILE = "pytorch_model.bin"
INDEX_FILE = "pytorch_model.bin.index.json"
CONFIG_FILE = "config.json"

# torch dtype -> (safetensors dtype, integer dtype of the same width, little-endian numpy type)
STORAGE = {
    torch.float16: ("F16", torch.int16, "<i2"),
    torch.bfloat16: ("BF16", torch.int16, "<i2"),
    torch.float32: ("F32", torch.int32, "<i4"),
    torch.float64: ("F64", torch.int64, "<i8"),
}
OUTPUT_DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
LAYER_NAME = re.compile(r"^(.*?)layers\.\d+\.attention\.")


class ConversionError(Exception):
    """A checkpoint, config or argument that cannot be converted; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    """The attention sizes of config.json, with the official defaults for missing keys."""
    dim: int
    n_head: int
    n_local_heads: int
    head_dim: int
    n_layer: int
    use_dcmha: bool
    use_qk_norm: bool


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: its name and the checkpoint tensors (name, official shape) whose
    rows it concatenates."""
    name: str
    sources: tuple


def read_config(path):
    """(ModelConfig, the raw config dict) of a config.json."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: cannot read the model config: {e}") from e
    dim, n_head = int(raw.get("dim", 2560)), int(raw.get("n_head", 32))
    n_local_heads = int(raw.get("n_local_heads", -1))
    if n_head < 2 or dim % n_head != 0:
        raise ConversionError(f"{path}: expected n_head >= 2 dividing dim, got n_head {n_head}, "
                              f"dim {dim}")
    config = ModelConfig(dim=dim, n_head=n_head,
                         n_local_heads=n_head if n_local_heads == -1 else n_local_heads,
                         head_dim=dim // n_head, n_layer=int(raw.get("n_layer", 32)),
                         use_dcmha=bool(raw.get("use_dcmha", True)),
                         use_qk_norm=bool(raw.get("use_qk_norm", False)))
    if config.n_local_heads < 1 or n_head % config.n_local_heads != 0:
        raise ConversionError(f"{path}: n_local_heads: expected a divisor of n_head {n_head}, "
                              f"got {config.n_local_heads}")
    if "head_dim" in raw and int(raw["head_dim"]) != config.head_dim:
        raise ConversionError(f"{path}: head_dim: expected dim / n_head = {config.head_dim}, "
                              f"got {raw['head_dim']}")
    return config, raw


def official_shapes(config):
    """suffix after "layers.i.attention." -> official shape, for the tensors the layer uses."""
    E, H, Hk, D = config.dim, config.n_head, config.n_local_heads, config.head_dim
    K, R = 4 * H, H // (H // 2)
    shapes = {"wq.weight": (H * D, E), "wk.weight": (Hk * D, E), "wv.weight": (Hk * D, E),
              "wqkv.weight": ((H + 2 * Hk) * D, E), "wo.weight": (E, H * D)}
    if config.use_dcmha:
        shapes.update({"dyn_w_proj.dw1": (E, 1, 4, K), "dyn_w_proj.qkw": (1, 4, K, 2 * R, H),
                       "dyn_w_proj.dd": (E, 1, 4 * H)})
    if config.use_qk_norm:
        shapes.update({"q_norm.scale": (D,), "k_norm.scale": (D,)})
    return shapes


def shape_text(shape):
    return "(" + ", ".join(str(d) for d in shape) + ")"


def missing(name, shape, extra=""):
    return ConversionError(f"{name}: missing from the checkpoint (expected a tensor of shape "
                           f"{shape_text(shape)}{extra})")


def plan_qkv(shapes, names, base):
    """The OutputTensor of wqkv: wq, wk and wv merged when wq is present (as the official load
    hook does, which then replaces wqkv), wqkv itself otherwise."""
    out = "wqkv.weight"
    if base + "wq.weight" in names:
        parts = ("wq.weight", "wk.weight", "wv.weight")
        for part in parts:
            if base + part not in names:
                raise missing(base + part, shapes[part], ", to merge with wq.weight into wqkv")
        return OutputTensor(out, tuple((base + p, shapes[p]) for p in parts))
    if base + out not in names:
        raise missing(base + out, shapes[out], ", or wq.weight, wk.weight and wv.weight")
    return OutputTensor(out, ((base + out, shapes[out]),))


def plan_layer(config, layer, names, prefix):
    """The output tensors of one layer, named without `prefix`; refuses missing tensors."""
    shapes = official_shapes(config)
    base = f"{prefix}layers.{layer}.attention."
    if not config.use_qk_norm:
        for suffix in ("q_norm.scale", "k_norm.scale"):
            if base + suffix in names:
                raise ConversionError(f"{base + suffix}: unexpected with use_qk_norm off: the "
                                      "model normalizes q and k; check the config")
    plan = [plan_qkv(shapes, names, base)]
    for suffix, shape in shapes.items():
        if suffix.startswith(("wq.", "wk.", "wv.", "wqkv.")):
            continue
        if base + suffix not in names:
            raise missing(base + suffix, shape)
        plan.append(OutputTensor(suffix, ((base + suffix, shape),)))
    out_base = f"layers.{layer}.attention."
    return [OutputTensor(out_base + t.name, t.sources) for t in plan]


def detect_prefix(names):
    """The text before "layers.N.attention." in the checkpoint's names (usually empty)."""
    prefixes = {m.group(1) for m in map(LAYER_NAME.match, names) if m}
    if not prefixes:
        raise ConversionError("no tensor named layers.N.attention.* in the checkpoint: not a "
                              "DCFormer state dict")
    if len(prefixes) > 1:
        raise ConversionError("tensors named layers.N.attention.* under several prefixes: "
                              + ", ".join(repr(p) for p in sorted(prefixes)))
    return prefixes.pop()


def unwrap_state_dict(obj, path):
    """The name -> tensor dict of a loaded file (a training checkpoint may nest it)."""
    if isinstance(obj, dict) and not any(torch.is_tensor(v) for v in obj.values()):
        for key in ("state_dict", "model", "module"):
            if isinstance(obj.get(key), dict):
                return unwrap_state_dict(obj[key], path)
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: expected a state dict, got {type(obj).__name__}")
    return obj


def load_state_dict(path):
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for unreadable or non-checkpoint files
        raise ConversionError(f"{path}: cannot load: {e}") from e
    return unwrap_state_dict(obj, path)


class Checkpoint:
    """A single-file or sharded checkpoint: its tensor names, and the loading of some of them
    (a sharded one loads only the shards that hold them, one at a time)."""

    def __init__(self, path):
        if os.path.isdir(path):
            index = os.path.join(path, INDEX_FILE)
            path = index if os.path.exists(index) else os.path.join(path, SINGLE_FILE)
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: no such file (expected {SINGLE_FILE}, {INDEX_FILE} "
                                  "or a directory holding one)")
        self.path = path
        self.directory = os.path.dirname(os.path.abspath(path))
        self.shard_of, self.tensors = None, None
        if path.endswith(".json"):
            self.shard_of = self._read_index(path)
            self.names = set(self.shard_of)
        else:
            self.tensors = load_state_dict(path)
            self.names = set(self.tensors)

    @staticmethod
    def _read_index(path):
        try:
            with open(path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"{path}: expected a JSON index with a weight_map: {e}") from e
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{path}: weight_map: expected an object")
        return weight_map

    def load(self, names):
        """name -> tensor for `names`, all of them in self.names."""
        if self.tensors is not None:
            return {name: self.tensors[name] for name in names}
        found = {}
        for shard in sorted({self.shard_of[name] for name in names}):
            shard_path = os.path.join(self.directory, shard)
            state = load_state_dict(shard_path)
            for name in (n for n in names if self.shard_of[n] == shard):
                if name not in state:
                    raise ConversionError(f"{name}: missing from shard {shard_path}, which "
                                          f"{os.path.basename(self.path)} names for it")
                found[name] = state[name]
            del state
        return found


def checked(name, tensor, shape):
    """`tensor`, refused unless a floating-point tensor of the official shape."""
    if not torch.is_tensor(tensor):
        raise ConversionError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dtype not in STORAGE:
        raise ConversionError(f"{name}: dtype: expected float16, bfloat16, float32 or float64, "
                              f"got {str(tensor.dtype).replace('torch.', '')}")
    if tuple(tensor.shape) != tuple(shape):
        raise ConversionError(f"{name}: expected shape {shape_text(shape)}, got "
                              f"{shape_text(tuple(tensor.shape))}")
    return tensor


def build_output(plan, tensors, dtype):
    """Output name -> tensor: the checked sources, concatenated, in `dtype` (None: theirs)."""
    out = {}
    for item in plan:
        parts = [checked(name, tensors[name], shape) for name, shape in item.sources]
        target = dtype
        if target is None:  # keep: mixed wq / wk / wv dtypes widen exactly to a common one
            target = parts[0].dtype
            for part in parts[1:]:
                target = torch.promote_types(target, part.dtype)
        parts = [part.to(target) for part in parts]
        out[item.name] = (torch.cat(parts) if len(parts) > 1 else parts[0]).contiguous()
    return out


def tensor_bytes(tensor):
    """The raw little-endian bytes of a contiguous tensor of a STORAGE dtype."""
    _, same_width, little_endian = STORAGE[tensor.dtype]
    return tensor.view(same_width).numpy().astype(little_endian, copy=False).tobytes()


def write_safetensors(path, tensors, metadata):
    """Writes `tensors` (name -> tensor) and `metadata` (str -> str) as a safetensors file:
    8-byte little-endian header size, JSON header padded with spaces to 8 bytes, data."""
    header, offset = {"__metadata__": metadata}, 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": STORAGE[t.dtype][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    temporary = path + ".partial"
    try:
        with open(temporary, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name in sorted(tensors):
                f.write(tensor_bytes(tensors[name]))
        os.replace(temporary, path)
    except OSError as e:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise ConversionError(f"{path}: cannot write: {e}") from e


def parse_layers(text, n_layer):
    """Layer indices of "0-3,8" style text (None: all n_layer layers), sorted and unique."""
    if text is None:
        return list(range(n_layer))
    layers = set()
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if not match:
            raise ConversionError(f"--layers: expected indices and ranges like 0-3,8, got {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else first
        if first > last or last >= n_layer:
            raise ConversionError(f"--layers: {item.strip()}: expected layers in 0..{n_layer - 1} "
                                  "(n_layer of the config)")
        layers.update(range(first, last + 1))
    return sorted(layers)


def convert(args):
    """Runs the conversion; returns the summary line."""
    checkpoint = Checkpoint(args.input)
    config_path = args.config or os.path.join(checkpoint.directory, CONFIG_FILE)
    config, raw_config = read_config(config_path)
    layers = parse_layers(args.layers, config.n_layer)
    prefix = detect_prefix(checkpoint.names)
    plan = [t for layer in layers for t in plan_layer(config, layer, checkpoint.names, prefix)]
    sources = [name for item in plan for name, _ in item.sources]
    tensors = build_output(plan, checkpoint.load(sources), OUTPUT_DTYPES[args.dtype])
    metadata = {"format": "pt", "dcformer_config": json.dumps(raw_config, sort_keys=True),
                "dcformer_layers": ",".join(str(i) for i in layers)}
    write_safetensors(args.output, tensors, metadata)
    dtypes = sorted({STORAGE[t.dtype][0] for t in tensors.values()})
    return (f"{PROG}: wrote {args.output}: {len(tensors)} tensors of {len(layers)} layers, "
            f"{'/'.join(dtypes)}")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert an official DCFormer PyTorch checkpoint's attention parameters to "
                    "the safetensors file read by examples/dcformer_attention/load_weights.hpp.")
    parser.add_argument("input", help=f"{SINGLE_FILE}, {INDEX_FILE} (shards beside it), or a "
                                      "directory holding one")
    parser.add_argument("output", help="the safetensors file to write")
    parser.add_argument("--dtype", choices=sorted(OUTPUT_DTYPES), default="keep",
                        help="dtype of the output tensors; keep (default): the checkpoint's "
                             "(float16, bfloat16, float32 or float64, all of which the loader "
                             "reads); the others convert, rounding to nearest even")
    parser.add_argument("--layers", help="layers to convert, e.g. 0-3,8 (default: all n_layer)")
    parser.add_argument("--config", help=f"the model's {CONFIG_FILE} (default: the one beside "
                                         "INPUT)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        print(convert(args))
    except ConversionError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/convert_dcformer_checkpoint.py on checkpoints written here from small random state dicts
in the official DCFormer names: single-file and sharded, the wq / wk / wv merge, dtypes, layer
selection, prefixes, refusals; and the C++ loader of examples/dcformer_attention reading the
output (a small program compiled from load_weights.hpp, skipped with the reason when no C++
compiler, Eigen 3 or nlohmann-json is found, or with DCMHA_SKIP_CXX_LOADER=1).

Run from python/tests: /usr/bin/python3 -m unittest test_convert_checkpoint
"""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "convert_dcformer_checkpoint.py")
EXAMPLE = os.path.join(ROOT, "examples", "dcformer_attention")

# E = 32, H = 4, Hk = 2 (GQA), D = 8, K = 4H = 16, R = 2.
CONFIG = {"architectures": ["DCFormer"], "model_type": "dcformer", "dim": 32, "n_head": 4,
          "n_local_heads": 2, "head_dim": 8, "n_layer": 2, "use_dcmha": True,
          "use_qk_norm": True, "window_size": 256, "window_type": "LGLL",
          "torch_dtype": "float16", "vocab_size": 11, "intermediate_size": 48}
ATTENTION = ("wqkv.weight", "wo.weight", "dyn_w_proj.dw1", "dyn_w_proj.qkw", "dyn_w_proj.dd",
             "q_norm.scale", "k_norm.scale")  # the loader's order
DTYPE_NAMES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
               "F64": torch.float64}


def load_converter():
    spec = importlib.util.spec_from_file_location("convert_dcformer_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONVERTER = load_converter()


def run_converter(*args):
    """The converter's main() in this process, as a subprocess would run it (its exit code,
    stdout, stderr), without importing torch again for each call (about 1.5 s); --help runs the
    script itself."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = CONVERTER.main(list(args))
        except SystemExit as e:  # argparse's refusals
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, stdout.getvalue(), stderr.getvalue())


def random_tensor(generator, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=generator).to(dtype)


def attention_tensors(g, config, split_qkv):
    """One layer's attention parameters and buffers as the official module holds them."""
    E, H, Hk = config["dim"], config["n_head"], config["n_local_heads"]
    D, K = E // H, 4 * H
    t = {"wo.weight": random_tensor(g, E, H * D), "dyn_w_proj.dw1": random_tensor(g, E, 1, 4, K),
         "dyn_w_proj.qkw": random_tensor(g, 1, 4, K, 4, H),
         "dyn_w_proj.dd": random_tensor(g, E, 1, 4 * H),
         "q_norm.scale": random_tensor(g, D), "k_norm.scale": random_tensor(g, D)}
    if split_qkv:
        t.update({"wq.weight": random_tensor(g, H * D, E), "wk.weight": random_tensor(g, Hk * D, E),
                  "wv.weight": random_tensor(g, Hk * D, E)})
    else:
        t["wqkv.weight"] = random_tensor(g, (H + 2 * Hk) * D, E)
    # The merged copies and identity buffers of the official module, which are not converted.
    t["dyn_w_proj.dw_m"] = torch.cat([t["dyn_w_proj.dw1"].reshape(E, -1),
                                      t["dyn_w_proj.dd"].squeeze(1)], dim=-1)
    t["dyn_w_proj.qkw_m"] = t["dyn_w_proj.qkw"].reshape(4, K, -1)
    identity = torch.eye(H, dtype=torch.float16).expand(1, H, H)
    t["dyn_w_proj.pre_proj.w"] = t["dyn_w_proj.post_proj.w"] = identity
    return t


def official_state_dict(config=CONFIG, seed=0):
    """A DCFormer state dict in the official names: layer 0 with the older split wq / wk / wv,
    the other layers with wqkv; embeddings, norms and feed-forward tensors too."""
    g = torch.Generator().manual_seed(seed)
    E, vocab, hidden = config["dim"], config["vocab_size"], config["intermediate_size"]
    state = {"tok_embeddings.weight": random_tensor(g, vocab, E),
             "norm.weight": random_tensor(g, E), "output.weight": random_tensor(g, vocab, E)}
    for i in range(config["n_layer"]):
        block = {f"attention.{k}": v for k, v in attention_tensors(g, config, i == 0).items()}
        block.update({"attention_norm.weight": random_tensor(g, E),
                      "ffn_norm.weight": random_tensor(g, E),
                      "feed_forward.w1.weight": random_tensor(g, hidden, E),
                      "feed_forward.w2.weight": random_tensor(g, E, hidden),
                      "feed_forward.w3.weight": random_tensor(g, hidden, E)})
        state.update({f"layers.{i}.{k}": v for k, v in block.items()})
    return state


def expected_output(state, config=CONFIG, layers=None, prefix=""):
    """Output name -> tensor that the conversion must produce from `state`."""
    suffixes = ["wqkv.weight", "wo.weight"]
    if config.get("use_dcmha", True):
        suffixes += ["dyn_w_proj.dw1", "dyn_w_proj.qkw", "dyn_w_proj.dd"]
    if config.get("use_qk_norm", False):
        suffixes += ["q_norm.scale", "k_norm.scale"]
    out = {}
    for i in range(config["n_layer"]) if layers is None else layers:
        base = f"layers.{i}.attention."
        for suffix in suffixes:
            name = prefix + base + suffix
            if suffix == "wqkv.weight" and name not in state:
                value = torch.cat([state[prefix + base + p]
                                   for p in ("wq.weight", "wk.weight", "wv.weight")])
            else:
                value = state[name]
            out[base + suffix] = value
    return out


def read_safetensors(path):
    """(name -> tensor, metadata) of a safetensors file, checking its layout on the way."""
    with open(path, "rb") as f:
        data = f.read()
    (header_size,) = struct.unpack("<Q", data[:8])
    assert header_size % 8 == 0, "header not padded to 8 bytes"
    header = json.loads(data[8:8 + header_size].decode("utf-8"))
    body = data[8 + header_size:]
    metadata = header.pop("__metadata__", {})
    assert all(isinstance(v, str) for v in metadata.values()), metadata
    tensors, end = {}, 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = entry["data_offsets"]
        assert begin == end, f"{name}: a gap or overlap before its data"
        dtype = DTYPE_NAMES[entry["dtype"]]
        flat = torch.frombuffer(bytearray(body[begin:stop]), dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"])
        end = stop
    assert end == len(body), "data after the last tensor"
    return tensors, metadata


def write_sharded(state, directory):
    """`state` as two shards and a pytorch_model.bin.index.json; layer 0's wk lands in the second
    shard, apart from its wq and wv."""
    shards = {"pytorch_model-00001-of-00002.bin": {}, "pytorch_model-00002-of-00002.bin": {}}
    first, second = shards.values()
    for name, tensor in state.items():
        late = name.startswith("layers.1.") or name == "layers.0.attention.wk.weight"
        (second if late else first)[name] = tensor
    weight_map = {}
    for file_name, tensors in shards.items():
        torch.save(tensors, os.path.join(directory, file_name))
        weight_map.update({name: file_name for name in tensors})
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


class ConverterCase(unittest.TestCase):
    """Temporary directories holding a checkpoint and its config, and the converter's runs."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="dcformer_convert_")
        self.addCleanup(shutil.rmtree, self.dir)

    def write_checkpoint(self, state, config=CONFIG, name="model", sharded=False):
        directory = os.path.join(self.dir, name)
        os.makedirs(directory)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f)
        if sharded:
            write_sharded(state, directory)
        else:
            torch.save(state, os.path.join(directory, "pytorch_model.bin"))
        return directory

    def convert(self, source, *options, output="out.safetensors"):
        output = os.path.join(self.dir, output)
        return run_converter(source, output, *options), output

    def convert_ok(self, source, *options):
        result, output = self.convert(source, *options)
        self.assertEqual(result.returncode, 0, result.stderr)
        return read_safetensors(output)

    def assert_same_tensors(self, actual, expected):
        self.assertEqual(sorted(actual), sorted(expected))
        for name, value in expected.items():
            self.assertEqual(actual[name].dtype, value.dtype, name)
            self.assertEqual(actual[name].shape, value.shape, name)
            self.assertTrue(torch.equal(actual[name], value), name)

    def assert_refused(self, source, *words):
        result, output = self.convert(source)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertTrue(result.stderr.startswith("convert_dcformer_checkpoint.py: "),
                        result.stderr)
        for word in words:
            self.assertIn(word, result.stderr)
        self.assertFalse(os.path.exists(output), "output written despite the error")


class ConversionTest(ConverterCase):

    def test_single_file_keeps_fp16_and_merges_wq_wk_wv(self):
        state = official_state_dict()
        tensors, metadata = self.convert_ok(self.write_checkpoint(state))
        self.assert_same_tensors(tensors, expected_output(state))
        self.assertEqual(tensors["layers.0.attention.wqkv.weight"].shape, (64, 32))
        self.assertEqual(json.loads(metadata["dcformer_config"]), CONFIG)
        self.assertEqual(metadata["dcformer_layers"], "0,1")

    def test_the_file_itself_as_input(self):
        state = official_state_dict()
        directory = self.write_checkpoint(state)
        tensors, _ = self.convert_ok(os.path.join(directory, "pytorch_model.bin"))
        self.assert_same_tensors(tensors, expected_output(state))

    def test_sharded_checkpoint(self):
        state = official_state_dict(seed=1)
        directory = self.write_checkpoint(state, sharded=True)
        self.assert_same_tensors(self.convert_ok(directory)[0], expected_output(state))
        index = os.path.join(directory, "pytorch_model.bin.index.json")
        self.assert_same_tensors(self.convert_ok(index)[0], expected_output(state))

    def test_dtype_conversions(self):
        state = {k: v.float() for k, v in official_state_dict(seed=2).items()}
        directory = self.write_checkpoint(state)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                            ("float16", torch.float16)):
            with self.subTest(dtype=name):
                tensors, _ = self.convert_ok(directory, "--dtype", name)
                expected = {k: v.to(dtype) for k, v in expected_output(state).items()}
                self.assert_same_tensors(tensors, expected)
        tensors, _ = self.convert_ok(directory)
        self.assert_same_tensors(tensors, expected_output(state))

    def test_bf16_checkpoint_kept(self):
        state = {k: v.to(torch.bfloat16) for k, v in official_state_dict(seed=3).items()}
        tensors, _ = self.convert_ok(self.write_checkpoint(state))
        self.assert_same_tensors(tensors, expected_output(state))

    def test_layer_selection(self):
        config = dict(CONFIG, n_layer=4)
        state = official_state_dict(config, seed=4)
        tensors, metadata = self.convert_ok(self.write_checkpoint(state, config), "--layers",
                                            "0,2-3")
        self.assert_same_tensors(tensors, expected_output(state, config, layers=[0, 2, 3]))
        self.assertEqual(metadata["dcformer_layers"], "0,2,3")
        result, _ = self.convert(self.write_checkpoint(state, config, "again"), "--layers", "4")
        self.assertEqual(result.returncode, 1)
        self.assertIn("--layers: 4: expected layers in 0..3", result.stderr)

    def test_nested_and_prefixed_training_checkpoint(self):
        state = {f"model.{k}": v for k, v in official_state_dict(seed=5).items()}
        directory = self.write_checkpoint({"state_dict": state, "step": 7})
        tensors, _ = self.convert_ok(directory)
        self.assert_same_tensors(tensors, expected_output(state, prefix="model."))

    def test_mha_model_without_qk_norm(self):
        config = dict(CONFIG, use_dcmha=False, use_qk_norm=False)
        state = {k: v for k, v in official_state_dict(config, seed=6).items()
                 if "_norm.scale" not in k}
        tensors, _ = self.convert_ok(self.write_checkpoint(state, config))
        self.assert_same_tensors(tensors, expected_output(state, config))
        self.assertEqual(len(tensors), 4)

    def test_help_names_the_dtypes(self):
        result = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True,
                                text=True)
        self.assertEqual(result.returncode, 0)
        self.assertIn("--dtype", result.stdout)
        self.assertIn("bfloat16", result.stdout)


class RefusalTest(ConverterCase):

    def refuse_edited(self, edit, *words, config=CONFIG):
        state = official_state_dict(config)
        edit(state)
        self.assert_refused(self.write_checkpoint(state, config), *words)

    def test_missing_tensor(self):
        self.refuse_edited(lambda s: s.pop("layers.1.attention.wo.weight"),
                           "layers.1.attention.wo.weight: missing", "(32, 32)")

    def test_missing_tensor_of_a_sharded_checkpoint(self):
        state = official_state_dict()
        del state["layers.1.attention.dyn_w_proj.qkw"]
        self.assert_refused(self.write_checkpoint(state, sharded=True),
                            "layers.1.attention.dyn_w_proj.qkw: missing", "(1, 4, 16, 4, 4)")

    def test_missing_wqkv(self):
        self.refuse_edited(lambda s: s.pop("layers.1.attention.wqkv.weight"),
                           "layers.1.attention.wqkv.weight: missing", "(64, 32)",
                           "wq.weight, wk.weight and wv.weight")

    def test_missing_part_of_wq_wk_wv(self):
        self.refuse_edited(lambda s: s.pop("layers.0.attention.wv.weight"),
                           "layers.0.attention.wv.weight: missing", "(16, 32)")

    def test_misshaped_wqkv(self):
        def cut(state):
            name = "layers.1.attention.wqkv.weight"
            state[name] = state[name][:63]
        self.refuse_edited(cut, "layers.1.attention.wqkv.weight: expected shape (64, 32), "
                                "got (63, 32)")

    def test_misshaped_wk_before_the_merge(self):
        def transpose(state):
            name = "layers.0.attention.wk.weight"
            state[name] = state[name].t().contiguous()
        self.refuse_edited(transpose, "layers.0.attention.wk.weight: expected shape (16, 32), "
                                      "got (32, 16)")

    def test_misshaped_dyn_w_proj(self):
        def merge_axes(state):
            name = "layers.0.attention.dyn_w_proj.dw1"
            state[name] = state[name].reshape(32, 64)
        self.refuse_edited(merge_axes, "layers.0.attention.dyn_w_proj.dw1: expected shape "
                                       "(32, 1, 4, 16), got (32, 64)")

    def test_integer_tensor(self):
        def to_int(state):
            name = "layers.1.attention.q_norm.scale"
            state[name] = state[name].to(torch.int32)
        self.refuse_edited(to_int, "layers.1.attention.q_norm.scale: dtype", "int32")

    def test_qk_norm_scale_with_qk_norm_off(self):
        self.refuse_edited(lambda s: None, "layers.0.attention.q_norm.scale: unexpected",
                           config=dict(CONFIG, use_qk_norm=False))

    def test_not_a_dcformer_checkpoint(self):
        self.assert_refused(self.write_checkpoint({"weight": torch.zeros(2)}),
                            "no tensor named layers.N.attention.*")

    def test_missing_config(self):
        directory = self.write_checkpoint(official_state_dict())
        os.remove(os.path.join(directory, "config.json"))
        self.assert_refused(directory, "config.json: cannot read the model config")


LOADER_PROBE = r"""
// Loads layers with dcformer::load_layer_weights<float>, appends their values (wqkv, wo, dw1,
// qkw, dd, q_norm, k_norm) as raw float32 to OUT and runs the layer's forward on them.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "load_weights.hpp"

int main(int argc, char** argv) {
  if (argc < 10) {
    std::fprintf(stderr, "usage: %s FILE OUT E H Hk D QK_NORM COMPOSE LAYER...\n", argv[0]);
    return 2;
  }
  try {
    dcformer::LayerConfig c;
    c.E = std::atol(argv[3]);
    c.H = std::atol(argv[4]);
    c.Hk = std::atol(argv[5]);
    c.D = std::atol(argv[6]);
    c.qk_norm = std::atoi(argv[7]) != 0;
    c.compose = std::atoi(argv[8]) != 0;
    c.num_threads = 1;
    const safetensors::File file(argv[1]);
    std::ofstream out(argv[2], std::ios::binary);
    const dcmha::index_t B = 1, T = 5;
    const auto rope = dcformer::make_rope_tables<float>(T, c.D);
    std::vector<float> x(B * T * c.E), y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i));
    for (int a = 9; a < argc; ++a) {
      const auto w = dcformer::load_layer_weights<float>(file, c, std::atol(argv[a]));
      for (const auto* v : {&w.wqkv, &w.wo, &w.dw1, &w.qkw, &w.dd, &w.q_norm, &w.k_norm})
        out.write(reinterpret_cast<const char*>(v->data()), std::streamsize(v->size() * 4));
      dcformer::LayerCache<float> cache;
      dcformer::forward(c, dcmha::view<3>(x.data(), {B, T, c.E}), rope.views(), w.views(),
                        dcmha::view<3>(y.data(), {B, T, c.E}), cache);
      double sum = 0;
      for (float v : y) sum += std::fabs(v);
      if (!std::isfinite(sum) || sum == 0) throw std::runtime_error("forward: output not finite "
                                                                    "or zero");
      std::printf("layer %s: loaded, forward sum|y| = %g\n", argv[a], sum);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
"""


def find_eigen():
    for directory in (os.environ.get("EIGEN3_INCLUDE_DIR"), "/usr/include/eigen3",
                      "/usr/local/include/eigen3"):
        if directory and os.path.exists(os.path.join(directory, "Eigen", "Core")):
            return directory
    return None


def loader_probe_unavailable():
    """Why the loader probe cannot be built here, or None."""
    if os.environ.get("DCMHA_SKIP_CXX_LOADER") == "1":
        return "DCMHA_SKIP_CXX_LOADER=1"
    if not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler (set CXX)"
    if not find_eigen():
        return "Eigen 3 headers not found (set EIGEN3_INCLUDE_DIR)"
    if not any(os.path.exists(os.path.join(d, "nlohmann", "json.hpp"))
               for d in ("/usr/include", "/usr/local/include")):
        return "nlohmann-json 3 headers not found (Debian: nlohmann-json3-dev)"
    return None


@unittest.skipIf(loader_probe_unavailable(), f"C++ loader check skipped: "
                                             f"{loader_probe_unavailable()}")
class CppLoaderTest(ConverterCase):
    """The C++ loader (load_weights.hpp) reads the converter's output: every value exactly, and
    the layer's forward runs on it."""

    @classmethod
    def setUpClass(cls):
        cls.build_dir = tempfile.mkdtemp(prefix="dcformer_loader_probe_")
        source = os.path.join(cls.build_dir, "probe.cpp")
        with open(source, "w") as f:
            f.write(LOADER_PROBE)
        cls.probe = os.path.join(cls.build_dir, "probe")
        command = [os.environ.get("CXX", "c++"), "-std=c++17", "-O0",
                   "-I" + os.path.join(ROOT, "include"), "-I" + EXAMPLE, "-I" + find_eigen(),
                   source, "-o", cls.probe]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(cls.build_dir)
            raise AssertionError("the loader probe does not compile:\n" + result.stderr[-4000:])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.build_dir, ignore_errors=True)

    def load_in_cpp(self, path, config, layers):
        values = os.path.join(self.dir, "values.f32")
        qk_norm, compose = config["use_qk_norm"], config["use_dcmha"]
        args = [path, values, config["dim"], config["n_head"], config["n_local_heads"],
                config["dim"] // config["n_head"], int(qk_norm), int(compose), *layers]
        result = subprocess.run([self.probe, *map(str, args)], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        for layer in layers:
            self.assertIn(f"layer {layer}: loaded", result.stdout)
        with open(values, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.float32)

    def check(self, state, config, *options, dtype=None):
        directory = self.write_checkpoint(state, config)
        result, output = self.convert(directory, *options)
        self.assertEqual(result.returncode, 0, result.stderr)
        expected = expected_output(state, config)
        layers = range(config["n_layer"])
        flat = [expected[f"layers.{i}.attention.{s}"] for i in layers for s in ATTENTION
                if f"layers.{i}.attention.{s}" in expected]
        want = torch.cat([(t if dtype is None else t.to(dtype)).float().reshape(-1)
                          for t in flat])
        self.assertTrue(torch.equal(self.load_in_cpp(output, config, layers), want))

    def test_fp16_output(self):
        self.check(official_state_dict(seed=7), CONFIG)

    def test_bf16_output(self):
        self.check(official_state_dict(seed=8), CONFIG, "--dtype", "bfloat16",
                   dtype=torch.bfloat16)

    def test_mha_float32_output(self):
        config = dict(CONFIG, use_dcmha=False, use_qk_norm=False)
        state = {k: v for k, v in official_state_dict(config, seed=9).items()
                 if "_norm.scale" not in k}
        self.check(state, config, "--dtype", "float32", dtype=torch.float32)


if __name__ == "__main__":
    unittest.main()

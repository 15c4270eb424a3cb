// From multi-head attention to DCMHA in one line.
//
// A template to copy into a model: activations live in (B, T, H, D) memory, the layout a fused
// QKV projection produces, and are handed to dcmha through bthd() views without any copy.
// The program runs the attention core twice on the same inputs, once as plain MHA and once
// with compose weights computed by the dynamic weight projection, then the backward pass of
// both (for DCMHA through the projection too), and prints how far apart they are. Last, the
// same DCMHA step with bf16 activations (the official checkpoints' type), the projection kept
// in float.
//
// Build: part of the dcmha tree (target mha_to_dcmha), or copy it next to a project that does
// find_package(dcmha) and links dcmha::dcmha.
#include <dcmha/dcmha.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

namespace {

using dcmha::index_t;

std::vector<float> randn(std::size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

double rms(const std::vector<float>& a) {
  double s = 0.0;
  for (float x : a) s += double(x) * x;
  return std::sqrt(s / double(a.size()));
}

std::vector<dcmha::bf16> to_bf16(const std::vector<float>& a) {
  std::vector<dcmha::bf16> r(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) r[i] = dcmha::bf16(a[i]);
  return r;
}

std::vector<float> to_float(const std::vector<dcmha::bf16>& a) {
  return std::vector<float>(a.begin(), a.end());
}

/// max |a - b| / max |b|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (float x : b) m = std::max(m, double(std::fabs(x)));
  return max_abs_diff(a, b) / std::max(m, 1e-30);
}

bool all_finite(const std::vector<float>& a) {
  for (float x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace

int main() {
  // Sizes of one small layer. G = 1 and R = 2 are the official DCFormer defaults: all heads
  // compose with each other through rank-2 query-wise and key-wise terms.
  const index_t B = 2, T = 64, H = 8, D = 32;
  const index_t G = 1, M = H / G, R = 2;
  const std::size_t n_act = static_cast<std::size_t>(B * T * H * D);
  const std::size_t n_lse = static_cast<std::size_t>(B * H * T);

  std::mt19937 rng(42);

  // ---- Inputs, laid out (B, T, H, D) as a model holds them -------------------------------
  std::vector<float> q = randn(n_act, 1.0f, rng), k = randn(n_act, 1.0f, rng),
                     v = randn(n_act, 1.0f, rng), dout = randn(n_act, 1.0f, rng);
  auto Q = dcmha::bthd(q.data(), B, T, H, D);
  auto K = dcmha::bthd(k.data(), B, T, H, D);
  auto V = dcmha::bthd(v.data(), B, T, H, D);
  auto dO = dcmha::bthd(dout.data(), B, T, H, D);

  // ---- Dynamic compose weights from the layer input x (B, T, E) ---------------------------
  // In a model x is the hidden state that the QKV projection also reads; here it is random,
  // and so are q, k, v above. Parameters use the official layout and init scales (spec 2).
  const index_t E = H * D, Kh = 4 * M;  // model width; hidden width K of the spec
  std::vector<float> x = randn(static_cast<std::size_t>(B * T * E), 1.0f, rng);
  std::vector<float> p_dw1 =
      randn(static_cast<std::size_t>(E * G * 4 * Kh), std::sqrt(2.0f / float(E + Kh)), rng);
  std::vector<float> p_qkw = randn(static_cast<std::size_t>(G * 4 * Kh * 2 * R * M),
                                   0.02f / (std::sqrt(2.0f * H * R) * float(H + R)), rng);
  std::vector<float> p_dd =
      randn(static_cast<std::size_t>(E * G * 4 * M), 0.05f * std::sqrt(2.0f / float(H + E)), rng);
  auto X = dcmha::view<3>(x.data(), {B, T, E});
  dcmha::DynamicWeightProjection<float> proj;
  proj.dw1 = dcmha::view<4>(p_dw1.data(), {E, G, 4, Kh});
  proj.qkw = dcmha::view<5>(p_qkw.data(), {G, 4, Kh, 2 * R, M});
  proj.dd = dcmha::view<3>(p_dd.data(), {E, G, 4 * M});
  dcmha::ProjectionConfig pcfg;  // exact (erf) GELU, as the official PyTorch code

  dcmha::DynamicWeightsStorage<float> dynw(B, T, G, R, M);
  const dcmha::DynamicWeights<float> dw = dynw.views();

  dcmha::AttentionConfig cfg;  // causal, scale 1/sqrt(D), all OpenMP threads
  cfg.mask = dcmha::Mask::causal;

  // ---- Outputs. lse (B, H, T) is the only state forward keeps for backward ----------------
  std::vector<float> o_mha(n_act), o_dc(n_act);
  std::vector<dcmha::acc_t<float>> lse_mha(n_lse), lse_dc(n_lse);
  auto O_mha = dcmha::bthd(o_mha.data(), B, T, H, D);
  auto O_dc = dcmha::bthd(o_dc.data(), B, T, H, D);
  auto LSE_mha = dcmha::view<3>(lse_mha.data(), {B, H, T});
  auto LSE_dc = dcmha::view<3>(lse_dc.data(), {B, H, T});

  // Gradients; dcmha overwrites them, so they need no zeroing between steps.
  std::vector<float> dq_mha(n_act), dk_mha(n_act), dv_mha(n_act);
  std::vector<float> dq_dc(n_act), dk_dc(n_act), dv_dc(n_act);
  dcmha::DynamicWeightsStorage<float> dynw_grad(B, T, G, R, M);
  const dcmha::DynamicWeights<float> ddw = dynw_grad.views();

  // bf16 storage: the same DCMHA step on bf16 activations. The projection runs in float (it is
  // float / double only): its twelve outputs are rounded into bf16 storage for the core, and the
  // core's gradients of them widened back for the projection's backward.
  const auto q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v), dout16 = to_bf16(dout);
  std::vector<dcmha::bf16> o16(n_act), dq16(n_act), dk16(n_act), dv16(n_act);
  std::vector<float> lse16(n_lse);
  dcmha::DynamicWeightsStorage<dcmha::bf16> dynw16(B, T, G, R, M), dynw16_grad(B, T, G, R, M);
  auto act16 = [&](auto& buf) { return dcmha::bthd(buf.data(), B, T, H, D); };

  // Gradients of the projection's input and parameters.
  std::vector<float> dx(x.size()), g_dw1(p_dw1.size()), g_qkw(p_qkw.size()), g_dd(p_dd.size());
  dcmha::DynamicWeightProjectionGrads<float> dproj;
  dproj.dw1 = dcmha::view<4>(g_dw1.data(), {E, G, 4, Kh});
  dproj.qkw = dcmha::view<5>(g_qkw.data(), {G, 4, Kh, 2 * R, M});
  dproj.dd = dcmha::view<3>(g_dd.data(), {E, G, 4 * M});

  // The kernels' buffers, kept from call to call (a training loop keeps one per calling thread
  // for all its layers and steps); the calls without it allocate their own each time.
  dcmha::Workspace workspace;
  // The projection's intermediate activations, kept by its forward for its backward (one per
  // layer in a training step, like any saved activation); without it the backward recomputes them.
  dcmha::ProjectionActivations<float> proj_act;

  try {
    // ---- Multi-head attention ---------------------------------------------------------------
    dcmha::forward(cfg, Q, K, V, O_mha, LSE_mha);
    dcmha::backward(cfg, Q, K, V, LSE_mha, dO, dcmha::bthd(dq_mha.data(), B, T, H, D),
                    dcmha::bthd(dk_mha.data(), B, T, H, D), dcmha::bthd(dv_mha.data(), B, T, H, D));

    // ---- DCMHA: the same calls, plus the compose weights ----------------------------------
    dcmha::dynamic_weights_forward(pcfg, X, proj, dw, proj_act);
    const dcmha::ComposeWeights<float> compose = dcmha::compose_weights<float>(dw);
    dcmha::forward(cfg, Q, K, V, O_dc, LSE_dc, compose, workspace);  // <- the one-line switch
    // Backward also writes d(dynamic weights), ready for the projection's backward pass.
    dcmha::backward(cfg, Q, K, V, LSE_dc, dO, dcmha::bthd(dq_dc.data(), B, T, H, D),
                    dcmha::bthd(dk_dc.data(), B, T, H, D), dcmha::bthd(dv_dc.data(), B, T, H, D),
                    compose, dcmha::compose_grads(ddw), workspace);
    // ...which carries the gradient on to x and the projection parameters.
    dcmha::dynamic_weights_backward(pcfg, X, proj, proj_act, ddw,
                                    dcmha::view<3>(dx.data(), {B, T, E}), dproj);

    // ---- DCMHA with bf16 activations --------------------------------------------------------
    dynw16.data = to_bf16(dynw.data);
    const dcmha::ComposeWeights<dcmha::bf16> compose16 =
        dcmha::compose_weights<dcmha::bf16>(dynw16.views());
    dcmha::forward(cfg, act16(q16), act16(k16), act16(v16), act16(o16),
                   dcmha::view<3>(lse16.data(), {B, H, T}), compose16, workspace);
    dcmha::backward(cfg, act16(q16), act16(k16), act16(v16),
                    dcmha::view<3>(lse16.data(), {B, H, T}), act16(dout16), act16(dq16),
                    act16(dk16), act16(dv16), compose16, dcmha::compose_grads(dynw16_grad.views()),
                    workspace);
    // to_float(dynw16_grad.data) is what dynamic_weights_backward would take next, as above.
  } catch (const dcmha::Error& e) {  // invalid argument: shapes, strides, switches
    std::fprintf(stderr, "dcmha rejected an argument: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcmha failed: %s\n", e.what());
    return 1;
  }

  std::printf(
      "B=%lld T=%lld H=%lld D=%lld, causal; DCMHA with G=%lld R=%lld (pre+post, "
      "query- and key-wise)\n",
      (long long)B, (long long)T, (long long)H, (long long)D, (long long)G, (long long)R);
  std::printf("out[b=0,t=%lld,h=0,d=0..3]  MHA  : % .5f % .5f % .5f % .5f\n", (long long)(T - 1),
              O_mha(0, 0, T - 1, 0), O_mha(0, 0, T - 1, 1), O_mha(0, 0, T - 1, 2),
              O_mha(0, 0, T - 1, 3));
  std::printf("out[b=0,t=%lld,h=0,d=0..3]  DCMHA: % .5f % .5f % .5f % .5f\n", (long long)(T - 1),
              O_dc(0, 0, T - 1, 0), O_dc(0, 0, T - 1, 1), O_dc(0, 0, T - 1, 2),
              O_dc(0, 0, T - 1, 3));
  std::printf("rms(out): MHA %.5f  DCMHA %.5f  max|diff| %.5f\n", rms(o_mha), rms(o_dc),
              max_abs_diff(o_mha, o_dc));
  std::printf("max|diff| of gradients: dq %.5f  dk %.5f  dv %.5f\n", max_abs_diff(dq_mha, dq_dc),
              max_abs_diff(dk_mha, dk_dc), max_abs_diff(dv_mha, dv_dc));
  std::printf("rms: dynamic weights %.5f  their grads %.5f  dx %.5f  d dw1 %.5f\n", rms(dynw.data),
              rms(dynw_grad.data), rms(dx), rms(g_dw1));

  // bf16 against float: bf16 keeps 8 significant bits, so the inputs' rounding (2^-9 relative)
  // and the results' own give differences of a few 2^-8 relative; a broken kernel gives O(1).
  const double bf16_out = rel_diff(to_float(o16), o_dc), bf16_dq = rel_diff(to_float(dq16), dq_dc),
               bf16_dk = rel_diff(to_float(dk16), dk_dc), bf16_dv = rel_diff(to_float(dv16), dv_dc),
               bf16_dw = rel_diff(to_float(dynw16_grad.data), dynw_grad.data);
  std::printf(
      "bf16 against float (max|diff| / max|float|): out %.4f  dq %.4f  dk %.4f  dv %.4f  "
      "d(dynamic weights) %.4f\n",
      bf16_out, bf16_dq, bf16_dk, bf16_dv, bf16_dw);
  for (double e : {bf16_out, bf16_dq, bf16_dk, bf16_dv, bf16_dw})
    if (!(e < 0.05)) {
      std::fprintf(stderr, "bf16 results differ from float by more than bf16 precision explains\n");
      return 1;
    }

  for (const auto* t : {&o_mha, &o_dc, &dq_mha, &dk_mha, &dv_mha, &dq_dc, &dk_dc, &dv_dc,
                        &dynw_grad.data, &dx, &g_dw1, &g_qkw, &g_dd}) {
    if (!all_finite(*t)) {
      std::fprintf(stderr, "non-finite values in a result\n");
      return 1;
    }
  }
  // At the official init the dynamic weights are small, so DCMHA starts close to MHA, but
  // never equal: an exact match would mean the compose weights were not used.
  if (max_abs_diff(o_mha, o_dc) == 0.0) {
    std::fprintf(stderr, "DCMHA output equals MHA output: compose weights were ignored\n");
    return 1;
  }
  return 0;
}

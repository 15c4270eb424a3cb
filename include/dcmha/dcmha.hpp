#pragma once
// dcmha: Dynamically Composable Multi-Head Attention (Xiao et al., ICML 2024), header-only.
//
//   attention.hpp        forward / backward of the attention core (MHA and DCMHA)
//   decode/decode.hpp    DecodeCache + decode: incremental decoding against a per-layer cache
//   dynamic_weights.hpp  the dynamic weight projection producing the compose inputs
//   compose_weights.hpp  ComposeWeights / ComposeGrads: the inputs of Compose
//   tensor.hpp           TensorView: strided views over caller memory
//   config.hpp           AttentionConfig: mask, scale, window, threads
//   error.hpp            dcmha::Error, thrown for every invalid argument
//   workspace.hpp        Workspace: the kernels' buffers, kept between calls
#include "attention.hpp"
#include "compose_weights.hpp"
#include "config.hpp"
#include "decode/decode.hpp"
#include "dynamic_weights.hpp"
#include "error.hpp"
#include "tensor.hpp"
#include "workspace.hpp"

#define DCMHA_VERSION_MAJOR 0
#define DCMHA_VERSION_MINOR 1
#define DCMHA_VERSION_PATCH 0

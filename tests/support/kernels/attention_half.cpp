// Forward and backward for half, compiled once for every test (see ../kernel_instances.hpp).
#include "support/kernel_instances.hpp"

DCMHA_TEST_ATTENTION_INSTANCES(template, dcmha::half)

// Decode and the dynamic weight projection, compiled once for every test (see
// ../kernel_instances.hpp).
#include "support/kernel_instances.hpp"

DCMHA_TEST_DECODE_INSTANCES(template, float)
DCMHA_TEST_DECODE_INSTANCES(template, double)
DCMHA_TEST_DECODE_INSTANCES(template, dcmha::bf16)
DCMHA_TEST_DECODE_INSTANCES(template, dcmha::half)
DCMHA_TEST_PROJECTION_INSTANCES(template, float)
DCMHA_TEST_PROJECTION_INSTANCES(template, double)
DCMHA_TEST_PROJECTION_INSTANCES(template, dcmha::bf16)
DCMHA_TEST_PROJECTION_INSTANCES(template, dcmha::half)

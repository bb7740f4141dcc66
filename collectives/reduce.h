// Element-wise reduction kernels of the CPU backend (internal to collectives/).
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "troupe/collectives/communicator.h"

namespace troupe::collectives {

// out[i] = a[i] op b[i] for i < count, then divided by `divisor` when divisor > 1 (the last step
// of an average; kAvg itself reduces as kSum). out may be a or b (same index only). bfloat16 and
// float16 are reduced in float32 and rounded to nearest even once per call.
void reduceBuffers(DataType type, ReduceOp op, void* out, const void* a, const void* b,
                   size_t count, int divisor);

// out[i] = in[i] / divisor (integer division for integer types); out may be in.
void divideBuffer(DataType type, void* out, const void* in, size_t count, int divisor);

// Conversions used by the kernels and by tests' references.
float bfloat16ToFloat(uint16_t value);
uint16_t floatToBfloat16(float value);  // round to nearest even; NaN stays NaN
float float16ToFloat(uint16_t value);
uint16_t floatToFloat16(float value);   // round to nearest even

}  // namespace troupe::collectives

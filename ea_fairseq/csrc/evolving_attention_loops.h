// The inner loops of the fused decoding step (evolving_attention.cpp), compiled twice
// there: for AVX2 + FMA, and for any CPU of the target; which one runs is decided at load
// time from the CPU's features. Included inside a namespace, after the standard headers it
// uses (<algorithm>, <cmath>, <cstdint>, <cstring>, <limits>); it includes nothing itself.

// Output tile: this many outputs stay in registers while all H * k * k taps pass over
// them (measured: 32 vectorises well with GCC; 16 did not).
constexpr int64_t kTile = 32;

// acc[j] = bias + sum over taps of w * window, for j < span (rounded up to whole tiles:
// the buffers carry kTile + k slack), for one output head.
template <typename scalar_t>
inline __attribute__((always_inline)) void convolve_block(
    const scalar_t* w, const scalar_t* window, scalar_t* acc, int64_t H, int64_t k,
    int64_t stride, int64_t span, scalar_t bias) {
  for (int64_t j0 = 0; j0 < span; j0 += kTile) {
    scalar_t t[kTile];
    for (int64_t jj = 0; jj < kTile; ++jj) t[jj] = bias;
    for (int64_t i = 0; i < H; ++i) {
      for (int64_t r = 0; r < k; ++r) {
        const scalar_t* row = window + (i * k + r) * stride + j0;
        const scalar_t* wr = w + (i * k + r) * k;
        for (int64_t c = 0; c < k; ++c) {
          const scalar_t wv = wr[c];  // the causal kernel's masked taps are zeros
          const scalar_t* in = row + c;
          for (int64_t jj = 0; jj < kTile; ++jj) t[jj] += wv * in[jj];
        }
      }
    }
    std::copy(t, t + kTile, acc + j0);
  }
}

// exp for the softmax of float rows in a loop the compiler vectorises (std::exp is a
// scalar call): exp(x) = 2^n e^r with |r| <= ln(2)/2 and Cephes' degree-7 polynomial for
// e^r (relative error about 1e-7, float's own precision). Inputs are x - max <= 0;
// below float's range (masked keys' -inf included) the result is exactly 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}
inline double exp_nonpositive(double x) { return std::exp(x); }

// One finished row of the step's map: in place, its softmax over the keys, as
// torch.softmax (masked keys weigh 0; a row with every key masked is NaN, as in torch);
// then context[0:D] = sum over keys of weight * values[key][0:D].
template <typename scalar_t>
inline __attribute__((always_inline)) void attend_row(scalar_t* x, int64_t n, const scalar_t* values,
                                                      scalar_t* context, int64_t D) {
  scalar_t top = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t s = 0; s < n; ++s) top = x[s] > top ? x[s] : top;
  if (top == -std::numeric_limits<scalar_t>::infinity()) {
    std::fill(x, x + n, std::numeric_limits<scalar_t>::quiet_NaN());
    std::fill(context, context + D, std::numeric_limits<scalar_t>::quiet_NaN());
    return;
  }
  for (int64_t s = 0; s < n; ++s) x[s] = exp_nonpositive(x[s] - top);
  scalar_t sum = 0;
  for (int64_t s = 0; s < n; ++s) sum += x[s];
  const scalar_t scale = scalar_t(1) / sum;
  for (int64_t s = 0; s < n; ++s) x[s] *= scale;
  // kTile context entries stay in registers while the keys pass over them
  int64_t d0 = 0;
  for (; d0 + kTile <= D; d0 += kTile) {
    scalar_t t[kTile] = {};
    for (int64_t s = 0; s < n; ++s) {
      const scalar_t p = x[s];
      const scalar_t* v = values + s * D + d0;
      for (int64_t jj = 0; jj < kTile; ++jj) t[jj] += p * v[jj];
    }
    std::copy(t, t + kTile, context + d0);
  }
  if (d0 < D) {
    std::fill(context + d0, context + D, scalar_t(0));
    for (int64_t s = 0; s < n; ++s) {
      const scalar_t p = x[s];
      const scalar_t* v = values + s * D;
      for (int64_t d = d0; d < D; ++d) context[d] += p * v[d];
    }
  }
}
// The entry points: not inlined into the caller, whose code is compiled for any CPU.
void convolve(const float* w, const float* window, float* acc, int64_t H, int64_t k,
              int64_t stride, int64_t span, float bias) {
  convolve_block<float>(w, window, acc, H, k, stride, span, bias);
}
void convolve(const double* w, const double* window, double* acc, int64_t H, int64_t k,
              int64_t stride, int64_t span, double bias) {
  convolve_block<double>(w, window, acc, H, k, stride, span, bias);
}
void attend(float* x, int64_t n, const float* values, float* context, int64_t D) {
  attend_row<float>(x, n, values, context, D);
}
void attend(double* x, int64_t n, const double* values, double* context, int64_t D) {
  attend_row<double>(x, n, values, context, D);
}

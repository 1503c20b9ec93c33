// The per-block work of the fused decoding step (evolving_attention.cpp), compiled twice
// there: for AVX2 + FMA, and for any CPU of the target; which one runs is decided at load
// time from the CPU's features. Included inside a namespace, after the standard headers it
// uses (<algorithm>, <cmath>, <cstdint>, <cstring>, <limits>) and the definition of
// StepData; it includes nothing itself.

// Output tile: this many outputs stay in registers while all H * k * k taps pass over
// them (measured: 32 vectorises well with GCC; 16 did not).
constexpr int64_t kTile = 32;

// acc[j] = bias + sum over taps of w * window, for j < span (rounded up to whole tiles:
// the buffers carry kTile + k slack), for one output head. Not inlined: inlined into
// step_block, GCC kept the tile on the stack (a store and a load per tap), 3x slower.
template <typename scalar_t>
__attribute__((noinline)) void convolve_block(
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
// torch.softmax (masked keys weigh 0; a row with every key masked gets zero weights and a
// zero context, as ea_ops.softmax.masked_softmax gives it);
// then context[0:D] = sum over keys of weight * values[key][0:D].
template <typename scalar_t>
inline __attribute__((always_inline)) void attend_row(scalar_t* x, int64_t n, const scalar_t* values,
                                                      scalar_t* context, int64_t D) {
  scalar_t top = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t s = 0; s < n; ++s) top = x[s] > top ? x[s] : top;
  if (top == -std::numeric_limits<scalar_t>::infinity()) {
    std::fill(x, x + n, scalar_t(0));
    std::fill(context, context + D, scalar_t(0));
    return;
  }
  for (int64_t s = 0; s < n; ++s) x[s] = exp_nonpositive(x[s] - top);
  scalar_t sum = 0;
  for (int64_t s = 0; s < n; ++s) sum += x[s];
  const scalar_t scale = scalar_t(1) / sum;
  for (int64_t s = 0; s < n; ++s) x[s] *= scale;
  // kTile context entries stay in registers while the keys pass over them; then tiles of
  // 8 (head sizes such as 40 = 32 + 8), then what is left
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
  for (; d0 + 8 <= D; d0 += 8) {
    scalar_t t[8] = {};
    for (int64_t s = 0; s < n; ++s) {
      const scalar_t p = x[s];
      const scalar_t* v = values + s * D + d0;
      for (int64_t jj = 0; jj < 8; ++jj) t[jj] += p * v[jj];
    }
    std::copy(t, t + 8, context + d0);
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
// out[s] = lerp(start[s], end[s], weight) with torch.lerp's formula (torch_lerp), the
// branch on the weight taken once per row so that the loop vectorises
template <typename scalar_t>
inline __attribute__((always_inline)) void lerp_row(const scalar_t* start, const scalar_t* end,
                                                    scalar_t weight, scalar_t* out, int64_t n) {
  if (weight < scalar_t(0.5)) {
    for (int64_t s = 0; s < n; ++s) out[s] = start[s] + weight * (end[s] - start[s]);
  } else {
    const scalar_t rest = scalar_t(1) - weight;
    for (int64_t s = 0; s < n; ++s) out[s] = end[s] - (end[s] - start[s]) * rest;
  }
}

// row[s] = fill where masked[s]
template <typename scalar_t>
inline __attribute__((always_inline)) void fill_row(scalar_t* row, const bool* masked, scalar_t fill,
                                                    int64_t n) {
  for (int64_t s = 0; s < n; ++s) row[s] = masked[s] ? fill : row[s];
}

// Hypotheses n0 .. n0 + nb - 1 of a decoding step (StepData, evolving_attention.cpp):
// their window of A_input rows (cached rows, then the new one), the next step's cache,
// the convolution, A_logit, and with values the weights and the context rows. `window`
// holds H * k * block * W (+ slack) entries, `acc` block * W (+ slack).
template <typename scalar_t>
void step_block(const StepData<scalar_t>& d, int64_t n0, int64_t nb, int64_t block,
                scalar_t* window, scalar_t* acc) {
  const int64_t H = d.H, S = d.S, k = d.k, R = k - 1, W = S + k - 1, S_prev = d.S_prev;
  const int64_t left = d.left;
  // locals: stores through the map rows could otherwise alias the scalars they are read from
  const scalar_t skip = d.alpha, residual = d.beta;
  const scalar_t fill = -std::numeric_limits<scalar_t>::infinity();
  std::fill(window, window + H * k * block * W, scalar_t(0));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t q = 0; q < nb; ++q) {
      const int64_t n = n0 + q;
      const int64_t from = d.order ? d.order[n] : n;
      for (int64_t r = 0; r < R && d.earlier; ++r) {
        const scalar_t* src = d.earlier + ((from * H + h) * R + r) * S_prev;
        std::copy(src, src + S_prev, window + ((h * k + r) * block + q) * W + left);
      }
      // the new row of A_input: skip connection, neutral zeros where masked
      const scalar_t* x = d.logits + (n * H + h) * S;
      scalar_t* cur = window + ((h * k + R) * block + q) * W + left;
      if (d.previous) {
        lerp_row(x, d.previous + (n * H + h) * S, skip, cur, S);
      } else {
        std::copy(x, x + S, cur);
      }
      if (d.masked) fill_row(cur, d.masked + n * S, scalar_t(0), S);
      // the next step's cache: the last k-1 rows, the new one included
      for (int64_t r = 0; r < R; ++r) {
        const scalar_t* src = window + ((h * k + r + 1) * block + q) * W + left;
        std::copy(src, src + S, d.rows_out + ((n * H + h) * R + r) * S);
      }
    }
  }
  const int64_t span = (nb - 1) * W + S;  // the last valid output + 1
  for (int64_t o = 0; o < H; ++o) {
    convolve_block(d.weight + o * H * k * k, window, acc, H, k, block * W, span,
                   d.bias ? d.bias[o] : scalar_t(0));
    for (int64_t q = 0; q < nb; ++q) {
      const int64_t n = n0 + q;
      scalar_t* conv = acc + q * W;
      for (int64_t s = 0; s < S; ++s) conv[s] = conv[s] > scalar_t(0) ? conv[s] : scalar_t(0);
      scalar_t* out = d.out + (n * H + o) * S;
      lerp_row(window + ((o * k + R) * block + q) * W + left, conv, residual, out, S);
      if (d.values) {  // the weights (masked keys -inf, weighing 0), and the context row
        if (d.masked) fill_row(out, d.masked + n * S, fill, S);
        attend_row(out, S, d.values + ((n / d.beams) * H + o) * S * d.D,
                   d.context + (n * H + o) * d.D, d.D);
      }
    }
  }
}

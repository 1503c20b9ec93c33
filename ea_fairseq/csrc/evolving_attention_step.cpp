// One incremental decoding step of Evolving Attention (EA paper Eq. 4), fused.
//
// For one new query row per hypothesis, with the convolution's k-1 earlier rows of
// A_input cached (EA decoder self-attention: masked kernel + shift, Fig. 3b;
// encoder-decoder attention: shift along the target axis, Fig. 3c):
//
//   A_input = alpha * A_logit(i-1) + (1 - alpha) * logits      (skipped when no previous)
//   A_input = 0 where masked                                   (neutral entries)
//   A_logit = beta * ReLU(Conv(A_input)) + (1 - beta) * A_input
//   A_logit = -inf where masked
//
// Conv reads, for output column j, rows (cached k-1 rows, then the new row) and columns
// j - left .. j - left + k - 1 (zero outside the map; cached rows narrower than the map,
// as in decoder self-attention, read zeros in the new columns). This is the PyTorch path
// of ea_fairseq/modules/evolving_attention.py in one pass: it removes the half dozen
// small tensor operations per attention and decoding step whose fixed costs dominate a
// step on CPU.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

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

// Compiled for AVX2 and for any x86-64 (or the target's default), chosen at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EA_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define EA_CLONES
#endif
EA_CLONES void convolve_block_float(const float* w, const float* window, float* acc, int64_t H,
                                    int64_t k, int64_t stride, int64_t span, float bias) {
  convolve_block<float>(w, window, acc, H, k, stride, span, bias);
}
EA_CLONES void convolve_block_double(const double* w, const double* window, double* acc,
                                     int64_t H, int64_t k, int64_t stride, int64_t span,
                                     double bias) {
  convolve_block<double>(w, window, acc, H, k, stride, span, bias);
}
inline void convolve(const float* w, const float* window, float* acc, int64_t H, int64_t k,
                     int64_t stride, int64_t span, float bias) {
  convolve_block_float(w, window, acc, H, k, stride, span, bias);
}
inline void convolve(const double* w, const double* window, double* acc, int64_t H, int64_t k,
                     int64_t stride, int64_t span, double bias) {
  convolve_block_double(w, window, acc, H, k, stride, span, bias);
}

// torch.lerp's formula (exact at both ends), so both paths round alike
template <typename scalar_t>
inline scalar_t lerp(scalar_t start, scalar_t end, scalar_t weight) {
  const scalar_t diff = end - start;
  return weight < scalar_t(0.5) ? start + weight * diff : end - diff * (scalar_t(1) - weight);
}

template <typename scalar_t>
void step_kernel(
    const at::Tensor& logits,    // (B, H, S), contiguous; overwritten with A_logit
    const at::Tensor& previous,  // (B, H, S) contiguous, or undefined
    const at::Tensor& earlier,   // (B, H, k-1, S_prev) contiguous, or undefined
    const at::Tensor& masked,    // (B, S) bool contiguous, or undefined
    const at::Tensor& weight,    // (H, H, k, k) contiguous, the (masked) kernel
    const at::Tensor& bias,      // (H) or undefined
    at::Tensor& rows_out,        // (B, H, k-1, S): the cache for the next step
    double alpha, double beta, int64_t left) {
  const int64_t B = logits.size(0), H = logits.size(1), S = logits.size(2);
  const int64_t k = weight.size(2), R = k - 1;
  const int64_t S_prev = earlier.defined() ? earlier.size(3) : 0;
  scalar_t* lg = logits.data_ptr<scalar_t>();
  const scalar_t* pv = previous.defined() ? previous.data_ptr<scalar_t>() : nullptr;
  const scalar_t* ea = earlier.defined() ? earlier.data_ptr<scalar_t>() : nullptr;
  const bool* mk = masked.defined() ? masked.data_ptr<bool>() : nullptr;
  const scalar_t* w = weight.data_ptr<scalar_t>();
  const scalar_t* bs = bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
  scalar_t* ro = rows_out.data_ptr<scalar_t>();
  const scalar_t a = static_cast<scalar_t>(alpha), b = static_cast<scalar_t>(beta);
  const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();

  // The convolution runs over blocks of hypotheses: for each tap, one long loop over the
  // block's rows laid end to end (each zero-bordered to W = S + k - 1 columns), so the
  // compiler vectorises it; the border columns between hypotheses are computed and dropped.
  const int64_t W = S + k - 1;
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(64, 4096 / W));
  const int64_t blocks = (B + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * H * k * k * W * block));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    // window[i][r][n][W]: the k rows input head i contributes for hypothesis n
    std::vector<scalar_t> window(H * k * block * W + kTile + k);
    std::vector<scalar_t> acc(block * W + kTile);
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t n0 = blk * block, nb = std::min(block, B - n0);
      std::fill(window.begin(), window.end(), scalar_t(0));
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t q = 0; q < nb; ++q) {
          const int64_t n = n0 + q;
          const bool* m = mk ? mk + n * S : nullptr;
          for (int64_t r = 0; r < R && ea; ++r) {
            const scalar_t* src = ea + ((n * H + h) * R + r) * S_prev;
            std::copy(src, src + S_prev, window.data() + ((h * k + r) * block + q) * W + left);
          }
          // the new row of A_input: skip connection, neutral zeros where masked
          const scalar_t* x = lg + (n * H + h) * S;
          const scalar_t* p = pv ? pv + (n * H + h) * S : nullptr;
          scalar_t* cur = window.data() + ((h * k + R) * block + q) * W + left;
          for (int64_t s = 0; s < S; ++s) {
            const scalar_t v = p ? lerp(x[s], p[s], a) : x[s];
            cur[s] = (m && m[s]) ? scalar_t(0) : v;
          }
          // the next step's cache: the last k-1 rows, the new one included
          for (int64_t r = 0; r < R; ++r) {
            const scalar_t* src = window.data() + ((h * k + r + 1) * block + q) * W + left;
            std::copy(src, src + S, ro + ((n * H + h) * R + r) * S);
          }
        }
      }
      const int64_t span = (nb - 1) * W + S;  // the last valid output + 1
      for (int64_t o = 0; o < H; ++o) {
        convolve(w + o * H * k * k, window.data(), acc.data(), H, k, block * W, span,
                 bs ? bs[o] : scalar_t(0));
        for (int64_t q = 0; q < nb; ++q) {
          const int64_t n = n0 + q;
          const bool* m = mk ? mk + n * S : nullptr;
          const scalar_t* cur = window.data() + ((o * k + R) * block + q) * W + left;
          const scalar_t* conv_row = acc.data() + q * W;
          scalar_t* out = lg + (n * H + o) * S;
          for (int64_t s = 0; s < S; ++s) {
            const scalar_t conv = conv_row[s] > scalar_t(0) ? conv_row[s] : scalar_t(0);
            out[s] = (m && m[s]) ? neg_inf : lerp(cur[s], conv, b);
          }
        }
      }
    }
  });
}

}  // namespace

// Returns (A_logit (B, H, 1, S), written into `logits`; the next step's cached rows).
std::vector<at::Tensor> evolving_attention_step(
    at::Tensor logits, c10::optional<at::Tensor> previous, c10::optional<at::Tensor> earlier,
    c10::optional<at::Tensor> masked, at::Tensor weight, c10::optional<at::Tensor> bias,
    double alpha, double beta, int64_t left) {
  TORCH_CHECK(logits.dim() == 4 && logits.size(2) == 1, "logits must be (B, H, 1, S)");
  TORCH_CHECK(logits.is_contiguous(), "logits must be contiguous");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == weight.size(3) && weight.size(2) > 1,
              "weight must be (H, H, k, k) with k > 1");
  const int64_t B = logits.size(0), H = logits.size(1), S = logits.size(3);
  const int64_t k = weight.size(2);
  TORCH_CHECK(weight.size(0) == H && weight.size(1) == H, "weight must map the map's heads");
  TORCH_CHECK(left >= 0 && left < k, "left padding must lie in [0, k)");
  auto check = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == logits.scalar_type() && t.is_contiguous(), name,
                " must be contiguous and of the logits' dtype");
  };
  at::Tensor prev_t, earlier_t, masked_t, bias_t;
  if (previous.has_value() && previous->defined()) {
    prev_t = *previous;
    check(prev_t, "previous");
    TORCH_CHECK(prev_t.numel() == logits.numel(), "previous must match the logits");
  }
  if (earlier.has_value() && earlier->defined()) {
    earlier_t = *earlier;
    check(earlier_t, "earlier");
    TORCH_CHECK(earlier_t.dim() == 4 && earlier_t.size(0) == B && earlier_t.size(1) == H &&
                    earlier_t.size(2) == k - 1 && earlier_t.size(3) <= S,
                "earlier rows must be (B, H, k-1, <=S)");
  }
  if (masked.has_value() && masked->defined()) {
    masked_t = *masked;
    TORCH_CHECK(masked_t.scalar_type() == at::kBool && masked_t.is_contiguous() &&
                    masked_t.numel() == B * S,
                "masked must be a contiguous (B, S) bool tensor");
  }
  if (bias.has_value() && bias->defined()) {
    bias_t = *bias;
    check(bias_t, "bias");
  }
  check(weight, "weight");
  auto rows_out = at::empty({B, H, k - 1, S}, logits.options());
  auto flat = logits.view({B, H, S});
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "evolving_attention_step", [&] {
    step_kernel<scalar_t>(flat, prev_t, earlier_t, masked_t, weight, bias_t, rows_out, alpha,
                          beta, left);
  });
  return {logits, rows_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("evolving_attention_step", &evolving_attention_step,
        "One incremental decoding step of Evolving Attention, EA Eq. (4), fused (CPU)");
}

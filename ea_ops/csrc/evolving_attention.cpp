// Evolving Attention (EA paper Eq. 4) kernels: the residual convolution's elementwise part
// in training (convolution_residual_forward/backward), and one incremental decoding step
// fused whole (evolving_attention_step).
//
// One incremental decoding step:
// For one new query row per hypothesis, with the convolution's k-1 earlier rows of
// A_input cached (EA decoder self-attention: masked kernel + shift, Fig. 3b;
// encoder-decoder attention: shift along the target axis, Fig. 3c):
//
//   A_input = alpha * A_logit(i-1) + (1 - alpha) * logits      (skipped when no previous)
//   A_input = 0 where masked                                   (neutral entries)
//   A_logit = beta * ReLU(Conv(A_input)) + (1 - beta) * A_input   (finite everywhere)
//   (optionally) P = softmax(A_logit) over the unmasked keys, the attention weights, and the
//   context P V (the value product, before the output projection): when no later layer
//   reads A_logit and no dropout acts on the weights, the step's whole attention after
//   QK^T is this one call
//
// Conv reads, for output column j, rows (cached k-1 rows, then the new row) and columns
// j - left .. j - left + k - 1 (zero outside the map; cached rows narrower than the map,
// as in decoder self-attention, read zeros in the new columns). This is the PyTorch path
// of ea_ops/reference.py (the reference) in one pass: it removes the half dozen
// small tensor operations per attention and decoding step whose fixed costs dominate a
// step on CPU.
// The few ATen headers it uses, not <torch/extension.h> (all of libtorch's C++ API): the
// first-use compile takes half the time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

// What one decoding step reads and writes, as raw pointers (see step_kernel below): the
// per-block work (step_block in evolving_attention_loops.h) reads it from either build.
template <typename scalar_t>
struct StepData {
  int64_t B, H, S, k, S_prev, D, beams, left;
  const scalar_t* logits;      // (B, H, S): the new rows
  scalar_t* out;               // (B, H, S): A_logit, or with values the weights
  const scalar_t* previous;    // (B, H, S) or null
  const scalar_t* earlier;     // (B_prev, H, k-1, S_prev) or null
  const int64_t* order;        // (B) or null
  const bool* masked;          // (B, S) or null
  const scalar_t* weight;      // (H, H, k, k)
  const scalar_t* bias;        // (H) or null
  scalar_t* rows_out;          // (B, H, k-1, S)
  const scalar_t* values;      // (B / beams * H, S, D) or null
  scalar_t* context;           // (B, H * D) when values
  scalar_t alpha, beta;
};

// torch.lerp's formula (exact at both ends), so both paths round alike
template <typename scalar_t>
inline scalar_t torch_lerp(scalar_t start, scalar_t end, scalar_t weight) {
  const scalar_t diff = end - start;
  return weight < scalar_t(0.5) ? start + weight * diff : end - diff * (scalar_t(1) - weight);
}

// The step's inner loops (evolving_attention_loops.h), compiled for AVX2 + FMA and for
// any CPU; the AVX2 build runs where the CPU has it. (Feature tests, not GCC's
// target_clones("arch=haswell"): that one asks for the CPU model, which a virtual machine
// may not report, and then silently runs the portable build.)
#if defined(__x86_64__) && defined(__GNUC__)
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "evolving_attention_loops.h"
#pragma GCC pop_options
}  // namespace avx2
#define EA_HAVE_AVX2_BUILD 1
#endif
namespace portable {
#include "evolving_attention_loops.h"
}  // namespace portable

// EA_FAIRSEQ_PORTABLE_KERNELS=1 runs the portable build on any CPU (to test it, or to
// compare the two)
bool portable_requested() {
  const char* v = std::getenv("EA_FAIRSEQ_PORTABLE_KERNELS");
  return v != nullptr && std::strcmp(v, "1") == 0;
}
#ifdef EA_HAVE_AVX2_BUILD
const bool kUseAvx2 =
    !portable_requested() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
const bool kUseAvx2 = false;
#endif

template <typename scalar_t>
inline void step_block(const StepData<scalar_t>& d, int64_t n0, int64_t nb, int64_t block,
                       scalar_t* window, scalar_t* acc) {
#ifdef EA_HAVE_AVX2_BUILD
  if (kUseAvx2) return avx2::step_block(d, n0, nb, block, window, acc);
#endif
  portable::step_block(d, n0, nb, block, window, acc);
}

template <typename scalar_t>
void step_kernel(
    const at::Tensor& logits,    // (B, H, S), contiguous
    at::Tensor& out,             // (B, H, S): A_logit, or with `values` the weights
    const at::Tensor& previous,  // (B, H, S) contiguous, or undefined
    const at::Tensor& earlier,   // (B_prev, H, k-1, S_prev) contiguous, or undefined
    const at::Tensor& order,     // (B) int64: hypothesis n's earlier rows are earlier[order[n]]
                                 // (beam search's reorder, applied here), or undefined: n
    const at::Tensor& masked,    // (B, S) bool contiguous, or undefined
    const at::Tensor& weight,    // (H, H, k, k) contiguous, the (masked) kernel
    const at::Tensor& bias,      // (H) or undefined
    at::Tensor& rows_out,        // (B, H, k-1, S): the cache for the next step
    const at::Tensor& values,    // (B_kv * H, S, d) contiguous, or undefined
    at::Tensor& context,         // (B, H * d): P V, written when `values` is defined
    double alpha, double beta, int64_t left) {
  StepData<scalar_t> d;
  d.B = logits.size(0), d.H = logits.size(1), d.S = logits.size(2), d.k = weight.size(2);
  d.S_prev = earlier.defined() ? earlier.size(3) : 0;
  d.D = values.defined() ? values.size(2) : 0;
  // beam search shares the encoder's values across a sentence's hypotheses (kept
  // sentence-major: hypothesis n reads the values of sentence n / beams)
  d.beams = values.defined() ? d.B / (values.size(0) / d.H) : 1;
  d.left = left;
  d.logits = logits.data_ptr<scalar_t>();
  d.out = out.data_ptr<scalar_t>();
  d.previous = previous.defined() ? previous.data_ptr<scalar_t>() : nullptr;
  d.earlier = earlier.defined() ? earlier.data_ptr<scalar_t>() : nullptr;
  d.order = order.defined() ? order.data_ptr<int64_t>() : nullptr;
  d.masked = masked.defined() ? masked.data_ptr<bool>() : nullptr;
  d.weight = weight.data_ptr<scalar_t>();
  d.bias = bias.defined() ? bias.data_ptr<scalar_t>() : nullptr;
  d.rows_out = rows_out.data_ptr<scalar_t>();
  d.values = values.defined() ? values.data_ptr<scalar_t>() : nullptr;
  d.context = values.defined() ? context.data_ptr<scalar_t>() : nullptr;
  d.alpha = static_cast<scalar_t>(alpha), d.beta = static_cast<scalar_t>(beta);
  const int64_t B = d.B, H = d.H, k = d.k;

  // The convolution runs over blocks of hypotheses: for each tap, one long loop over the
  // block's rows laid end to end (each zero-bordered to W = S + k - 1 columns), so the
  // compiler vectorises it; the border columns between hypotheses are computed and dropped.
  const int64_t W = d.S + k - 1;
  // The block's window (H * k rows of W per hypothesis) stays within 24 KiB, in L1 with the
  // output rows (measured: benchmarks/README.md). No larger than the batch either: the
  // block's buffers are zeroed for every block.
  const int64_t window_elems = 24 * 1024 / static_cast<int64_t>(sizeof(scalar_t));
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>({64, window_elems / (H * k * W), B}));
  const int64_t blocks = (B + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * H * k * k * W * block));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    // window[i][r][n][W]: the k rows input head i contributes for hypothesis n
    std::vector<scalar_t> window(H * k * block * W + portable::kTile + k);
    std::vector<scalar_t> acc(block * W + portable::kTile);
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t n0 = blk * block;
      step_block(d, n0, std::min(block, B - n0), block, window.data(), acc.data());
    }
  });
}

}  // namespace

// Training and full passes: Eq. (4) around the convolution, one pass each way.
//
//   input:    A_input = 0 where neutral, else lerp(logits, A_logit(i-1), alpha)
//             (or logits without a previous map), written channels-last: the layout of
//             oneDNN's fast small-channel convolutions, so the convolution reads it as is;
//   residual: A_logit = -inf where masked, else lerp(A_input, ReLU(C), beta), with
//             C = conv[:, :, :T, :S] read from the convolution's uncropped output.
// Backward passes write each gradient in the layout of the tensor it belongs to (the
// convolution's, border zeros included; A_input's channels-last), so autograd needs no
// crop, copy or layout conversion between them. Every tensor is read through its
// strides; masks are bool tensors expanded to the map's shape (zero strides).
namespace {

struct Map4 {  // the strides of a 4-D view
  int64_t s0, s1, s2, s3;
  explicit Map4(const at::Tensor& t)
      : s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), s3(t.stride(3)) {}
  int64_t at(int64_t b, int64_t h, int64_t t, int64_t s) const {
    return b * s0 + h * s1 + t * s2 + s * s3;
  }
};

bool defined(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_map(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.sizes() == like.sizes(), name, " must be a (B, H, T, S) map");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must be of the map's dtype");
}

void check_mask(const c10::optional<at::Tensor>& m, const at::Tensor& like) {
  if (defined(m)) {
    TORCH_CHECK(m->scalar_type() == at::kBool && m->sizes() == like.sizes(),
                "masks must be bool and expanded to the map's shape");
  }
}

void check_conv(const at::Tensor& conv, const at::Tensor& like) {
  TORCH_CHECK(conv.dim() == 4 && conv.size(0) == like.size(0) && conv.size(1) == like.size(1) &&
                  conv.size(2) >= like.size(2) && conv.size(3) >= like.size(3),
              "the convolution output must cover the map");
  TORCH_CHECK(conv.scalar_type() == like.scalar_type(), "conv must be of the map's dtype");
}

int64_t grain_rows(int64_t H, int64_t S) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * S)); }

}  // namespace

at::Tensor evolving_attention_input_forward(at::Tensor logits, c10::optional<at::Tensor> previous,
                                            c10::optional<at::Tensor> neutral, double alpha) {
  TORCH_CHECK(logits.dim() == 4, "logits must be a (B, H, T, S) map");
  if (defined(previous)) check_map(*previous, logits, "previous");
  check_mask(neutral, logits);
  const int64_t B = logits.size(0), H = logits.size(1), T = logits.size(2), S = logits.size(3);
  auto out = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::ChannelsLast));
  const Map4 xm(logits), om(out);
  const Map4 pm(defined(previous) ? *previous : logits), nm(defined(neutral) ? *neutral : logits);
  const bool* nk = defined(neutral) ? neutral->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "evolving_attention_input_forward", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const scalar_t* pv = defined(previous) ? previous->data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t a = static_cast<scalar_t>(alpha);
    at::parallel_for(0, B * T, grain_rows(H, S), [&](int64_t first, int64_t last) {
      // locals, not captures: stores through the map rows could alias captured scalars
      const scalar_t skip = a;
      const int64_t x_step = xm.s3, p_step = pm.s3, n_step = nm.s3, o_step = om.s3;
      for (int64_t row = first; row < last; ++row) {
        const int64_t b = row / T, t = row % T;
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* x_row = x + xm.at(b, h, t, 0);
          scalar_t* o_row = o + om.at(b, h, t, 0);
          if (pv) {
            const scalar_t* p_row = pv + pm.at(b, h, t, 0);
            for (int64_t s = 0; s < S; ++s)
              o_row[s * o_step] = torch_lerp(x_row[s * x_step], p_row[s * p_step], skip);
          } else {
            for (int64_t s = 0; s < S; ++s) o_row[s * o_step] = x_row[s * x_step];
          }
          if (nk) {  // neutral zeros (also replaces the previous map's -inf)
            const bool* n_row = nk + nm.at(b, h, t, 0);
            for (int64_t s = 0; s < S; ++s)
              o_row[s * o_step] = n_row[s * n_step] ? scalar_t(0) : o_row[s * o_step];
          }
        }
      }
    });
  });
  return out;
}

// (dlogits, dprevious or undefined), both contiguous.
std::vector<at::Tensor> evolving_attention_input_backward(at::Tensor grad,
                                                          c10::optional<at::Tensor> neutral,
                                                          double alpha, bool has_previous) {
  TORCH_CHECK(grad.dim() == 4, "grad must be a (B, H, T, S) map");
  check_mask(neutral, grad);
  const int64_t B = grad.size(0), H = grad.size(1), T = grad.size(2), S = grad.size(3);
  auto grad_x = at::empty(grad.sizes(), grad.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor grad_p;
  if (has_previous) grad_p = at::empty_like(grad_x);
  const Map4 gm(grad), nm(defined(neutral) ? *neutral : grad);
  const bool* nk = defined(neutral) ? neutral->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "evolving_attention_input_backward", [&] {
    const scalar_t* g = grad.data_ptr<scalar_t>();
    scalar_t* gx = grad_x.data_ptr<scalar_t>();
    scalar_t* gp = has_previous ? grad_p.data_ptr<scalar_t>() : nullptr;
    const scalar_t a = static_cast<scalar_t>(alpha);
    at::parallel_for(0, B * T, grain_rows(H, S), [&](int64_t first, int64_t last) {
      const scalar_t w_prev = gp ? a : scalar_t(0), w_x = gp ? scalar_t(1) - a : scalar_t(1);
      const int64_t g_step = gm.s3, n_step = nm.s3;
      for (int64_t row = first; row < last; ++row) {
        const int64_t b = row / T, t = row % T;
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* g_row = g + gm.at(b, h, t, 0);
          const bool* n_row = nk ? nk + nm.at(b, h, t, 0) : nullptr;
          scalar_t* gx_row = gx + ((b * H + h) * T + t) * S;
          for (int64_t s = 0; s < S; ++s) gx_row[s] = g_row[s * g_step];
          if (n_row) {
            for (int64_t s = 0; s < S; ++s) gx_row[s] = n_row[s * n_step] ? scalar_t(0) : gx_row[s];
          }
          if (gp) {
            scalar_t* gp_row = gp + ((b * H + h) * T + t) * S;
            for (int64_t s = 0; s < S; ++s) {
              gp_row[s] = gx_row[s] * w_prev;
              gx_row[s] = gx_row[s] * w_x;
            }
          }
        }
      }
    });
  });
  return {grad_x, grad_p};
}

at::Tensor convolution_residual_forward(at::Tensor a_input, at::Tensor conv,
                                        c10::optional<at::Tensor> masked, double beta) {
  TORCH_CHECK(a_input.dim() == 4, "A_input must be a (B, H, T, S) map");
  check_conv(conv, a_input);
  check_mask(masked, a_input);
  const int64_t B = a_input.size(0), H = a_input.size(1), T = a_input.size(2),
                S = a_input.size(3);
  auto out = at::empty(a_input.sizes(), a_input.options().memory_format(at::MemoryFormat::Contiguous));
  const Map4 am(a_input), cm(conv), mm(defined(masked) ? *masked : a_input);
  const bool* mk = defined(masked) ? masked->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(a_input.scalar_type(), "convolution_residual_forward", [&] {
    const scalar_t* a = a_input.data_ptr<scalar_t>();
    const scalar_t* c = conv.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t bt = static_cast<scalar_t>(beta);
    at::parallel_for(0, B * T, grain_rows(H, S), [&](int64_t first, int64_t last) {
      // locals, not captures: stores through o_row could alias a captured scalar
      const scalar_t weight = bt, fill = -std::numeric_limits<scalar_t>::infinity();
      const int64_t a_step = am.s3, c_step = cm.s3, m_step = mm.s3;
      for (int64_t row = first; row < last; ++row) {
        const int64_t b = row / T, t = row % T;
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* a_row = a + am.at(b, h, t, 0);
          const scalar_t* c_row = c + cm.at(b, h, t, 0);
          scalar_t* o_row = o + ((b * H + h) * T + t) * S;
          for (int64_t s = 0; s < S; ++s) {
            const scalar_t cv = c_row[s * c_step];
            o_row[s] = torch_lerp(a_row[s * a_step], cv > scalar_t(0) ? cv : scalar_t(0), weight);
          }
          if (mk) {
            const bool* m_row = mk + mm.at(b, h, t, 0);
            for (int64_t s = 0; s < S; ++s) o_row[s] = m_row[s * m_step] ? fill : o_row[s];
          }
        }
      }
    });
  });
  return out;
}

// (dA_input in A_input's layout, dConv in conv's layout and size: zero where cropped,
// masked or ReLU-clipped).
std::vector<at::Tensor> convolution_residual_backward(at::Tensor grad, at::Tensor conv,
                                                      c10::optional<at::Tensor> masked,
                                                      double beta, bool channels_last_input) {
  TORCH_CHECK(grad.dim() == 4, "grad must be a (B, H, T, S) map");
  check_conv(conv, grad);
  check_mask(masked, grad);
  const int64_t B = grad.size(0), H = grad.size(1), T = grad.size(2), S = grad.size(3);
  const int64_t Tc = conv.size(2), Sc = conv.size(3);
  auto grad_a = at::empty(grad.sizes(), grad.options().memory_format(
      channels_last_input ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous));
  auto grad_c = at::empty_like(conv, at::MemoryFormat::Preserve);
  const Map4 gm(grad), cm(conv), gam(grad_a), gcm(grad_c), mm(defined(masked) ? *masked : grad);
  const bool* mk = defined(masked) ? masked->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "convolution_residual_backward", [&] {
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* c = conv.data_ptr<scalar_t>();
    scalar_t* ga = grad_a.data_ptr<scalar_t>();
    scalar_t* gc = grad_c.data_ptr<scalar_t>();
    const scalar_t bt = static_cast<scalar_t>(beta);
    at::parallel_for(0, B * Tc, grain_rows(H, Sc), [&](int64_t first, int64_t last) {
      // locals, not captures: stores through the gradient rows could alias captured scalars
      const scalar_t w_conv = bt, w_input = scalar_t(1) - bt;
      const int64_t g_step = gm.s3, c_step = cm.s3, ga_step = gam.s3, gc_step = gcm.s3,
                    m_step = mm.s3;
      for (int64_t row = first; row < last; ++row) {
        const int64_t b = row / Tc, t = row % Tc;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* gc_row = gc + gcm.at(b, h, t, 0);
          if (t >= T) {  // the convolution's cropped border rows
            for (int64_t s = 0; s < Sc; ++s) gc_row[s * gc_step] = scalar_t(0);
            continue;
          }
          const scalar_t* g_row = g + gm.at(b, h, t, 0);
          const scalar_t* c_row = c + cm.at(b, h, t, 0);
          const bool* m_row = mk ? mk + mm.at(b, h, t, 0) : nullptr;
          scalar_t* ga_row = ga + gam.at(b, h, t, 0);
          // branch-free selects (-fno-trapping-math): the ReLU's signs are random
          for (int64_t s = 0; s < S; ++s) {
            const scalar_t gv = g_row[s * g_step];
            const scalar_t kept = (m_row && m_row[s * m_step]) ? scalar_t(0) : gv;
            ga_row[s * ga_step] = kept * w_input;
            const scalar_t through = kept * w_conv;
            gc_row[s * gc_step] = c_row[s * c_step] > scalar_t(0) ? through : scalar_t(0);
          }
          for (int64_t s = S; s < Sc; ++s) gc_row[s * gc_step] = scalar_t(0);  // border columns
        }
      }
    });
  });
  return {grad_a, grad_c};
}

// Returns (A_logit (B, H, 1, S) -- or with `values` (B_kv * H, S, d) its softmax over the
// keys --, a new tensor (`logits` is only read); the next step's cached rows; with
// `values`, the context P V as (1, B, H * d), the output projection's input, else None).
std::vector<at::Tensor> evolving_attention_step(
    at::Tensor logits, c10::optional<at::Tensor> previous, c10::optional<at::Tensor> earlier,
    c10::optional<at::Tensor> masked, at::Tensor weight, c10::optional<at::Tensor> bias,
    double alpha, double beta, int64_t left, c10::optional<at::Tensor> values,
    c10::optional<at::Tensor> order) {
  TORCH_CHECK(logits.dim() == 4 && logits.size(2) == 1, "logits must be (B, H, 1, S)");
  // inputs are read contiguous (a no-op for the decoder's tensors, and cheaper here than
  // a Python call per tensor)
  logits = logits.contiguous();
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == weight.size(3) && weight.size(2) > 1,
              "weight must be (H, H, k, k) with k > 1");
  const int64_t B = logits.size(0), H = logits.size(1), S = logits.size(3);
  const int64_t k = weight.size(2);
  TORCH_CHECK(weight.size(0) == H && weight.size(1) == H, "weight must map the map's heads");
  TORCH_CHECK(left >= 0 && left < k, "left padding must lie in [0, k)");
  auto check = [&](const at::Tensor& t, const char* name) {  // (each is made contiguous first)
    TORCH_CHECK(t.scalar_type() == logits.scalar_type(), name, " must be of the logits' dtype");
  };
  at::Tensor prev_t, earlier_t, masked_t, bias_t, order_t;
  if (previous.has_value() && previous->defined()) {
    prev_t = previous->contiguous();
    check(prev_t, "previous");
    TORCH_CHECK(prev_t.numel() == logits.numel(), "previous must match the logits");
  }
  if (earlier.has_value() && earlier->defined()) {
    earlier_t = earlier->contiguous();
    check(earlier_t, "earlier");
    TORCH_CHECK(earlier_t.dim() == 4 && earlier_t.size(1) == H && earlier_t.size(2) == k - 1 &&
                    earlier_t.size(3) <= S,
                "earlier rows must be (B, H, k-1, <=S)");
    if (order.has_value() && order->defined()) {
      order_t = order->contiguous();
      TORCH_CHECK(order_t.scalar_type() == at::kLong && order_t.dim() == 1 && order_t.size(0) == B,
                  "order must be an int64 vector with one entry per hypothesis");
      const int64_t* od = order_t.data_ptr<int64_t>();
      for (int64_t n = 0; n < B; ++n) {
        TORCH_CHECK(od[n] >= 0 && od[n] < earlier_t.size(0), "order[", n, "] = ", od[n],
                    " does not index the ", earlier_t.size(0), " cached hypotheses");
      }
    } else {
      TORCH_CHECK(earlier_t.size(0) == B, "earlier rows must be (B, H, k-1, <=S)");
    }
  }
  if (masked.has_value() && masked->defined()) {
    masked_t = masked->contiguous();
    TORCH_CHECK(masked_t.scalar_type() == at::kBool && masked_t.numel() == B * S,
                "masked must be a (B, S) bool tensor");
  }
  if (bias.has_value() && bias->defined()) {
    bias_t = bias->contiguous();
    check(bias_t, "bias");
  }
  weight = weight.contiguous();
  check(weight, "weight");
  at::Tensor values_t, context;
  if (values.has_value() && values->defined()) {
    values_t = values->contiguous();
    check(values_t, "values");
    TORCH_CHECK(values_t.dim() == 3 && values_t.size(1) == S && values_t.size(0) % H == 0 &&
                    values_t.size(0) > 0 && B % (values_t.size(0) / H) == 0,
                "values must be (B_kv * H, S, head_dim), B a multiple of B_kv");
    context = at::empty({1, B, H * values_t.size(2)}, logits.options());
  }
  auto rows_out = at::empty({B, H, k - 1, S}, logits.options());
  auto result = at::empty(logits.sizes(), logits.options());
  auto flat = logits.view({B, H, S});
  auto flat_out = result.view({B, H, S});
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "evolving_attention_step", [&] {
    step_kernel<scalar_t>(flat, flat_out, prev_t, earlier_t, order_t, masked_t, weight, bias_t, rows_out,
                          values_t, context, alpha, beta, left);
  });
  return {result, rows_out, context};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("step_loops_build", [] { return std::string(kUseAvx2 ? "avx2" : "portable"); },
        "Which build of the decoding step's loops runs here: avx2 or portable");
  m.def("evolving_attention_step", &evolving_attention_step,
        "One incremental decoding step of Evolving Attention, EA Eq. (4), fused (CPU); with "
        "values it returns the attention weights instead of A_logit, and the context "
        "(weights times values)",
        py::arg("logits"), py::arg("previous"), py::arg("earlier"), py::arg("masked"),
        py::arg("weight"), py::arg("bias"), py::arg("alpha"), py::arg("beta"), py::arg("left"),
        py::arg("values") = py::none(), py::arg("order") = py::none());
  m.def("evolving_attention_input_forward", &evolving_attention_input_forward,
        "EA Eq. (4) line 1 before the convolution: neutral-filled lerp(logits, previous, alpha), "
        "channels-last");
  m.def("evolving_attention_input_backward", &evolving_attention_input_backward,
        "Gradients of evolving_attention_input_forward");
  m.def("convolution_residual_forward", &convolution_residual_forward,
        "EA Eq. (4) line 2 after the convolution: masked lerp(A_input, ReLU(C), beta)");
  m.def("convolution_residual_backward", &convolution_residual_backward,
        "Gradients of convolution_residual_forward");
}

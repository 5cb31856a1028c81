// Decode attention straight from a paged KV cache, float32, CPU.
//
// One query token per sequence attends to its first context_lens[b] cached tokens,
// read in place from the pages its block table names: no gather copy, no padding.
// Work items are (sequence, KV head) pairs spread over torch's intra-op threads
// (at::parallel_for). With AVX-512 and a head size of 32, 64 or 128 (attend_blocks), an item
// reads its context once, in blocks of 16 tokens: the K rows scored against every query
// row of the grouped-query group (Ainslie et al. 2023, GQA), 16 dot products reduced
// together, the online softmax (Milakov & Gimelshein 2018), then the same block's V rows.
// Elsewhere (attend) an item reads its K rows once, takes the softmax (max-subtracted),
// then reads its V rows once.
// The same computation as kernels/paged_attention_ref.py (decode_attention_ref);
// results differ from it in float32 summation order and, with AVX-512, by the vector exp
// (~1 ulp; a weight that would underflow below FLT_MIN is FLT_MIN) and, in attend_blocks,
// by the online softmax's rescales (~1 ulp each time a row's running maximum grows).
//
// rope_paged_decode_attention does a decode layer's whole attention after the fused QKV
// projection: RoPE on the query and the new key, the new key and value written to their
// slot (the context's last position), then the attention above.
//
// Built on first use by kernels/cpu_extension.py (torch.utils.cpp_extension);
// registered as torch.ops.mm_serve_cpu.paged_decode_attention and
// torch.ops.mm_serve_cpu.rope_paged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Asks for the `bytes` at `p` ahead of use (a page's rows are contiguous; pages are scattered).
inline void prefetch(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

#if defined(__AVX512F__)
// The first min(n, 16) lanes.
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// exp(x) on 16 lanes, for x <= 0 (a score minus its row's maximum): Cody-Waite reduction
// by ln 2 (n = round(x / ln 2), r = x - n ln 2 in two parts) and Cephes' degree-5 minimax
// polynomial for expf (Moshier, Cephes Math Library, expf.c), scaled by 2^n. Within ~1.3 ulp
// of std::exp; below -87.3365 the result is clamped to FLT_MIN (1.18e-38) instead of going
// subnormal or to 0; a NaN stays NaN (max returns its second operand when one is NaN). The
// scalar std::exp it replaces took a fifth of a decode layer's attention on one core.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3365447504f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// Scores s[0, length) -> softmax weights in place (max-subtracted; the sum taken once).
inline void softmax_in_place(float* s, int64_t length) {
#if defined(__AVX512F__)
  // The maximum on 16 lanes (a scalar max chain took an eighth of the attention). A NaN
  // score may be dropped from it, but its exp below is NaN and poisons the sum all the same.
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < length; t += 16) {
    vmax = _mm512_mask_max_ps(vmax, lanes(length - t), vmax, _mm512_maskz_loadu_ps(lanes(length - t), s + t));
  }
  const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; t += 16) {
    const __mmask16 m = lanes(length - t);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vtop));
    _mm512_mask_storeu_ps(s + t, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  const float total = _mm512_reduce_add_ps(vsum);
#else
  const float top = *std::max_element(s, s + length);
  float total = 0.f;
  for (int64_t t = 0; t < length; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
#endif
  const float inv = 1.f / total;
  for (int64_t t = 0; t < length; ++t) s[t] *= inv;
}

// What both attention paths read from their arguments: sizes, strides, data pointers and
// the work split. A work item is one sequence's KV heads [h0, h0 + heads): all of them when
// there are sequences enough to keep every thread busy, so that each page is read as one
// contiguous block; otherwise one head per item.
struct PagedView {
  int64_t batch, num_heads, head_dim, page_size, num_kv_heads, group, max_pages;
  int64_t k_page_stride, v_page_stride, row_stride;  // row_stride: one token inside a page
  const float* q_data;
  const float* k_data;
  const float* v_data;
  const int64_t* tables;
  const int64_t* lens;
  float* out_data;
  int64_t heads, items_per_seq, chunk_bytes;  // chunk_bytes: an item's part of one token row

  PagedView(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, int64_t fixed_head_dim)
      : batch(query.size(0)), num_heads(query.size(1)),
        head_dim(fixed_head_dim > 0 ? fixed_head_dim : query.size(2)), page_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), group(num_heads / num_kv_heads), max_pages(block_tables.size(1)),
        k_page_stride(k_cache.stride(0)), v_page_stride(v_cache.stride(0)), row_stride(num_kv_heads * head_dim),
        q_data(query.data_ptr<float>()), k_data(k_cache.data_ptr<float>()), v_data(v_cache.data_ptr<float>()),
        tables(block_tables.data_ptr<int64_t>()), lens(context_lens.data_ptr<int64_t>()),
        out_data(out.data_ptr<float>()), heads(batch >= 4 * at::get_num_threads() ? num_kv_heads : 1),
        items_per_seq(num_kv_heads / heads), chunk_bytes(heads * head_dim * static_cast<int64_t>(sizeof(float))) {}
};

#if defined(__AVX512F__)
// The 16 lane sums of a[0..15], in order, in one vector: s[i] = a[i][0] + ... + a[i][15].
// A transposing tree (pairs of lanes, then pairs of 64-bit halves, then 128-bit blocks):
// 45 shuffles and adds for 16 sums, against ~8 each for 16 separate reductions.
inline __m512 lane_sums16(const __m512* a) {
  __m512 pair[8];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: a2i x, a2i+1 x, a2i y, a2i+1 y
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 quad[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: the block's partial sums of a4i .. a4i+3
    const __m512d x = _mm512_castps_pd(pair[2 * i]), y = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 half[2];
  for (int i = 0; i < 2; ++i) {  // blocks: quad 2i's blocks 0+1, 2+3, then quad 2i+1's
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[t] = scale * (q . rows[t][offset, offset + kHeadDim)), t < n <= 16: one query row against
// up to 16 key rows, the 16 sums reduced together by lane_sums16 (rows past n are not read).
template <int64_t kHeadDim>
inline void score_block(const float* q, const float* const* rows, int64_t offset, int64_t n, float scale, float* out) {
  constexpr int64_t kVectors = kHeadDim / 16;
  __m512 qv[kVectors];
  for (int64_t i = 0; i < kVectors; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  __m512 acc[16];
  for (int64_t t = 0; t < 16; ++t) {
    if (t < n) {
      const float* k = rows[t] + offset;
      acc[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int64_t i = 1; i < kVectors; ++i) acc[t] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), acc[t]);
    } else {
      acc[t] = _mm512_setzero_ps();
    }
  }
  _mm512_mask_storeu_ps(out, lanes(n), _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
}

// acc[r] = rescale[r] * acc[r] + sum over t < n of weights[r * weight_stride + t] * rows[t][offset ...],
// for the kCount query rows sharing one KV head (a compile-time count, so that the sums stay
// in registers); acc rows are kHeadDim apart.
template <int64_t kHeadDim, int64_t kCount>
inline void weigh_block(const float* weights, int64_t weight_stride, const float* rescale, const float* const* rows,
                        int64_t offset, int64_t n, float* acc) {
  constexpr int64_t kVectors = kHeadDim / 16;
  __m512 sum[kCount][kVectors];
  for (int64_t r = 0; r < kCount; ++r) {
    const __m512 c = _mm512_set1_ps(rescale[r]);
    for (int64_t i = 0; i < kVectors; ++i) sum[r][i] = _mm512_mul_ps(c, _mm512_loadu_ps(acc + r * kHeadDim + 16 * i));
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* v = rows[t] + offset;
    __m512 vv[kVectors];
    for (int64_t i = 0; i < kVectors; ++i) vv[i] = _mm512_loadu_ps(v + 16 * i);
    for (int64_t r = 0; r < kCount; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r * weight_stride + t]);
      for (int64_t i = 0; i < kVectors; ++i) sum[r][i] = _mm512_fmadd_ps(w, vv[i], sum[r][i]);
    }
  }
  for (int64_t r = 0; r < kCount; ++r) {
    for (int64_t i = 0; i < kVectors; ++i) _mm512_storeu_ps(acc + r * kHeadDim + 16 * i, sum[r][i]);
  }
}

// weigh_block for `count` rows, in passes of up to 4 (head size 32 or 64: GQA groups are mostly
// powers of two; 6 would still fit the 32 vector registers) or 2 (128: 3 would not fit).
template <int64_t kHeadDim>
inline void weigh_rows(const float* weights, int64_t weight_stride, const float* rescale, int64_t count,
                       const float* const* rows, int64_t offset, int64_t n, float* acc) {
  constexpr int64_t kMost = kHeadDim <= 64 ? 4 : 2;
  for (; count >= kMost; count -= kMost, weights += kMost * weight_stride, rescale += kMost, acc += kMost * kHeadDim) {
    weigh_block<kHeadDim, kMost>(weights, weight_stride, rescale, rows, offset, n, acc);
  }
  if (count >= 2) {
    weigh_block<kHeadDim, 2>(weights, weight_stride, rescale, rows, offset, n, acc);
    count -= 2, weights += 2 * weight_stride, rescale += 2, acc += 2 * kHeadDim;
  }
  if (count == 1) weigh_block<kHeadDim, 1>(weights, weight_stride, rescale, rows, offset, n, acc);
}

// attend() for head sizes that are whole AVX-512 vectors (32, 64, 128), in one pass over blocks
// of 16 tokens with the online softmax (Milakov & Gimelshein 2018; the decode form of
// FlashAttention, Dao et al. 2022): each block's K rows are scored (score_block), its weights
// taken against the running maximum, the sums so far rescaled when the maximum grows, and its
// V rows added (weigh_block). A page's K and V blocks lie side by side in the page-major cache,
// so a context is read as one stream of 2 x 16-row chunks instead of a K pass and a V pass.
// Same work items and the same per-row order whatever an item's span of heads (so results do
// not depend on the thread count).
template <int64_t kHeadDim>
void attend_blocks(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, at::Tensor& out) {
  constexpr int64_t kBlock = 16, kAhead = 2;
  const PagedView view(query, k_cache, v_cache, block_tables, context_lens, out, kHeadDim);

  at::parallel_for(0, view.batch * view.items_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = view.heads * view.group;  // query rows of an item
    std::vector<float> weights(rows * kBlock), running_max(rows), running_sum(rows), rescale(rows);
    std::vector<float> acc(rows * kHeadDim);
    const float* k_rows[kBlock];
    const float* v_rows[kBlock];
    const float* k_ahead[kBlock];
    const float* v_ahead[kBlock];
    // The K and V row pointers of tokens [first, first + n) of sequence b at heads from h0.
    auto row_pointers = [&](int64_t b, int64_t h0, int64_t first, int64_t n, const float** k_out, const float** v_out) {
      const int64_t* table = view.tables + b * view.max_pages;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t, page = table[pos / view.page_size];
        const int64_t offset = (pos % view.page_size) * view.row_stride + h0 * kHeadDim;
        k_out[t] = view.k_data + page * view.k_page_stride + offset;
        v_out[t] = view.v_data + page * view.v_page_stride + offset;
      }
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / view.items_per_seq, h0 = (item % view.items_per_seq) * view.heads;
      const int64_t length = view.lens[b];
      const float* q = view.q_data + (b * view.num_heads + h0 * view.group) * kHeadDim;
      std::fill(running_max.begin(), running_max.end(), -INFINITY);
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0; first < length; first += kBlock) {
        const int64_t n = std::min(kBlock, length - first);
        const __mmask16 m = lanes(n);
        row_pointers(b, h0, first, n, k_rows, v_rows);
        // The K and V rows two blocks ahead are fetched meanwhile: 8 % faster than no software
        // prefetch on one Xeon core (one block ahead about the same, four no better).
        const int64_t ahead = first + kAhead * kBlock;
        if (ahead < length) {
          const int64_t ahead_n = std::min(kBlock, length - ahead);
          row_pointers(b, h0, ahead, ahead_n, k_ahead, v_ahead);
          for (int64_t t = 0; t < ahead_n; ++t) prefetch(k_ahead[t], view.chunk_bytes), prefetch(v_ahead[t], view.chunk_bytes);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* w = weights.data() + r * kBlock;
          score_block<kHeadDim>(q + r * kHeadDim, k_rows, (r / view.group) * kHeadDim, n, scale, w);
          const __m512 s = _mm512_maskz_loadu_ps(m, w);
          // A NaN score may be dropped from the maximum, but its weight below is NaN and
          // poisons the row's sum all the same, as in the reference.
          const float top = std::max(running_max[r], _mm512_mask_reduce_max_ps(m, s));
          if (top == -INFINITY) {  // -inf scores so far: weight 0 (-inf - -inf would be NaN)
            _mm512_storeu_ps(w, _mm512_setzero_ps());
            rescale[r] = 1.f;
            continue;
          }
          const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top))));
          _mm512_storeu_ps(w, e);
          rescale[r] = running_max[r] == top ? 1.f : std::exp(running_max[r] - top);
          running_sum[r] = running_sum[r] * rescale[r] + _mm512_reduce_add_ps(e);
          running_max[r] = top;
        }
        for (int64_t h = 0; h < view.heads; ++h) {
          const int64_t r = h * view.group;
          weigh_rows<kHeadDim>(weights.data() + r * kBlock, kBlock, rescale.data() + r, view.group, v_rows, h * kHeadDim, n,
                               acc.data() + r * kHeadDim);
        }
      }
      float* o = view.out_data + (b * view.num_heads + h0 * view.group) * kHeadDim;
      for (int64_t r = 0; r < rows; ++r) {
        // A row of -inf scores only has nothing to weigh: 0, as torch's attention gives (a NaN sum stays NaN).
        const float inv = running_sum[r] == 0.f ? 0.f : 1.f / running_sum[r];
        for (int64_t d = 0; d < kHeadDim; ++d) o[r * kHeadDim + d] = acc[r * kHeadDim + d] * inv;
      }
    }
  });
}
#endif

// kHeadDim: the head size as a compile-time constant (the common 32, 64 and 128, so the dot
// products unroll fully), or 0 to read it from the tensors.
template <int64_t kHeadDim>
void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, at::Tensor& out) {
  const PagedView view(query, k_cache, v_cache, block_tables, context_lens, out, kHeadDim);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : view.head_dim;  // a constant where the template fixes it

  at::parallel_for(0, view.batch * view.items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(view.heads * view.group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / view.items_per_seq, h0 = (item % view.items_per_seq) * view.heads;
      const int64_t length = view.lens[b];
      const int64_t rows = view.heads * view.group;  // query heads of this item
      const int64_t* table = view.tables + b * view.max_pages;
      const float* q = view.q_data + (b * view.num_heads + h0 * view.group) * head_dim;  // `rows` rows of head_dim
      const int64_t num_pages = (length + view.page_size - 1) / view.page_size;
      scores.resize(rows * length);
      for (int64_t p = 0; p < num_pages; ++p) {
        const float* page = view.k_data + table[p] * view.k_page_stride + h0 * head_dim;
        // While this K page is scored, the next K page and this V page (read in the
        // second pass, from L2 by then) are fetched.
        const float* v_page = view.v_data + table[p] * view.v_page_stride + h0 * head_dim;
        const float* next = p + 1 < num_pages ? view.k_data + table[p + 1] * view.k_page_stride + h0 * head_dim : nullptr;
        const int64_t first = p * view.page_size, last = std::min(length, first + view.page_size);
        for (int64_t t = first; t < last; ++t) {
          if (next != nullptr) prefetch(next + (t - first) * view.row_stride, view.chunk_bytes);
          prefetch(v_page + (t - first) * view.row_stride, view.chunk_bytes);
          const float* k = page + (t - first) * view.row_stride;
          for (int64_t r = 0; r < rows; ++r) {
            scores[r * length + t] = dot(q + r * head_dim, k + (r / view.group) * head_dim, head_dim) * scale;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) softmax_in_place(scores.data() + r * length, length);
      acc.assign(rows * head_dim, 0.f);
      // While V (fetched during the K pass) is summed from cache, the next item's K pages
      // are fetched: each pass pairs one page stream with compute on data already here.
      const bool has_next = item + 1 < end;
      const int64_t next_b = (item + 1) / view.items_per_seq, next_h0 = ((item + 1) % view.items_per_seq) * view.heads;
      const int64_t next_pages = has_next ? (view.lens[next_b] + view.page_size - 1) / view.page_size : 0;
      const int64_t* next_table = view.tables + next_b * view.max_pages;
      for (int64_t p = 0; p < num_pages; ++p) {
        const float* page = view.v_data + table[p] * view.v_page_stride + h0 * head_dim;
        const float* ahead = p < next_pages ? view.k_data + next_table[p] * view.k_page_stride + next_h0 * head_dim : nullptr;
        const int64_t first = p * view.page_size, last = std::min(length, first + view.page_size);
        for (int64_t t = first; t < last; ++t) {
          if (ahead != nullptr) prefetch(ahead + (t - first) * view.row_stride, view.chunk_bytes);
          const float* v = page + (t - first) * view.row_stride;
          for (int64_t r = 0; r < rows; ++r) {
            axpy(scores[r * length + t], v + (r / view.group) * head_dim, acc.data() + r * head_dim, head_dim);
          }
        }
      }
      std::copy(acc.begin(), acc.end(), view.out_data + (b * view.num_heads + h0 * view.group) * head_dim);
    }
  });
}

// The checks both entry points share: devices, dtypes, cache layout, tables and lengths
// (every page a context reads is a page of the cache).
void check_cache_and_tables(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t batch) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "paged decode attention: CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged decode attention: float32 only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must both be [P, S, Hkv, D]");
  TORCH_CHECK(k_cache.size(1) >= 1 && k_cache.size(2) >= 1 && k_cache.size(3) >= 1,
              "caches need S >= 1 tokens a page, Hkv >= 1 KV heads and D >= 1");
  for (const at::Tensor* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(cache->stride(3) == 1 && cache->stride(2) == cache->size(3) &&
                    cache->stride(1) == cache->size(2) * cache->size(3),
                "each cache page must be a contiguous [S, Hkv, D] block (any page stride)");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && block_tables.is_contiguous(),
              "block_tables must be a contiguous [B, max_pages] tensor");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong, "block_tables must be int64");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == batch &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 [B] tensor");
  const int64_t page_size = k_cache.size(1), capacity = block_tables.size(1) * page_size;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* page_ids = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= capacity, "context_lens[", b, "] = ", lens[b],
                " is outside [1, max_pages * page_size = ", capacity, "]");
    for (int64_t i = 0; i < (lens[b] + page_size - 1) / page_size; ++i) {
      const int64_t page = page_ids[b * block_tables.size(1) + i];
      TORCH_CHECK(page >= 0 && page < k_cache.size(0), "block_tables[", b, ", ", i, "] = ", page,
                  " is not a page of the cache (", k_cache.size(0), " pages)");
    }
  }
}

// A head size the templates fix (32, 64, 128): the blocked one-pass path with AVX-512, else the two-pass one.
template <int64_t kHeadDim>
void attend_fixed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, at::Tensor& out) {
#if defined(__AVX512F__)
  attend_blocks<kHeadDim>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
#else
  attend<kHeadDim>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
#endif
}

at::Tensor attend_checked(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  at::Tensor out = at::empty_like(query);
  const float fscale = static_cast<float>(scale);
  switch (query.size(2)) {
    case 32:
      attend_fixed<32>(query, k_cache, v_cache, block_tables, context_lens, fscale, out);
      break;
    case 64:
      attend_fixed<64>(query, k_cache, v_cache, block_tables, context_lens, fscale, out);
      break;
    case 128:
      attend_fixed<128>(query, k_cache, v_cache, block_tables, context_lens, fscale, out);
      break;
    default:
      attend<0>(query, k_cache, v_cache, block_tables, context_lens, fscale, out);
  }
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat, "query: float32 only, on the CPU");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [B, Hq, D] tensor");
  check_cache_and_tables(k_cache, v_cache, block_tables, context_lens, query.size(0));
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  return attend_checked(query, k_cache, v_cache, block_tables, context_lens, scale);
}

// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (the GPT-NeoX / Llama form
// of RoPE, Su et al. 2021; transformers' apply_rotary_pos_emb), for one head of `dim` values.
// Not contracted into fused multiply-adds, so the result equals the reference's two
// rounded products and rounded sum bit for bit.
__attribute__((optimize("fp-contract=off"))) inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (int64_t i = half; i < dim; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

at::Tensor rope_paged_decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                       int64_t num_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat, "qkv: float32 only, on the CPU");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous [B, (Hq + 2 Hkv) * D] tensor");
  check_cache_and_tables(k_cache, v_cache, block_tables, context_lens, qkv.size(0));
  const int64_t batch = qkv.size(0), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  TORCH_CHECK(num_heads >= 1 && num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(head_dim % 2 == 0, "RoPE needs an even head_dim");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && qkv.is_contiguous(),
              "qkv must be a contiguous [B, (Hq + 2 Hkv) * D] tensor");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == batch && t->size(1) == head_dim &&
                    t->is_contiguous(),
                "cos and sin must be contiguous float32 [B, D] tensors");
  }
  at::Tensor query = at::empty({batch, num_heads, head_dim}, qkv.options());
  const float* qkv_data = qkv.data_ptr<float>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = sin.data_ptr<float>();
  float* q_data = query.data_ptr<float>();
  float* k_data = k_cache.data_ptr<float>();
  float* v_data = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t page_size = k_cache.size(1), row_stride = num_kv_heads * head_dim;
  for (int64_t b = 0; b < batch; ++b) {  // ~(Hq + Hkv) * D multiplies a row: not worth threads
    const float* row = qkv_data + b * width;
    const float* c = cos_data + b * head_dim;
    const float* s = sin_data + b * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * head_dim, c, s, q_data + (b * num_heads + h) * head_dim, head_dim);
    const int64_t position = lens[b] - 1;  // the new token is the context's last
    const int64_t page = tables[b * block_tables.size(1) + position / page_size];
    const int64_t offset = (position % page_size) * row_stride;
    float* k_slot = k_data + page * k_cache.stride(0) + offset;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      rotate(row + (num_heads + h) * head_dim, c, s, k_slot + h * head_dim, head_dim);
    }
    std::copy(row + (num_heads + num_kv_heads) * head_dim, row + width, v_data + page * v_cache.stride(0) + offset);
  }
  return attend_checked(query, k_cache, v_cache, block_tables, context_lens, scale);
}

}  // namespace

TORCH_LIBRARY(mm_serve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("rope_paged_decode_attention(Tensor qkv, Tensor cos, Tensor sin, int num_heads, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.impl("rope_paged_decode_attention", c10::DispatchKey::CPU, &rope_paged_decode_attention);
}

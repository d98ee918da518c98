// Swin's whole window attention in one kernel each way, on tensor cores, for windows of up to 64 tokens (window 7)
// and head dim 32 in half or bfloat16: out = softmax(q k^T * scale + bias[head] + mask[window]) @ v.
//
// q, k and v are read straight from the qkv projection (B_, N, 3C) and the output is written as (B_, N, C), ready
// for the output projection: no head permutes, no (B_, heads, N, N) tensor in memory. A block owns one head and walks
// a strided set of windows that all sit at one shift-mask position, so its bias (gathered from the relative-position
// table) + mask is read once, and in the backward each lane sums its bias-gradient elements over those windows in
// registers, then the block adds them up per table entry in shared memory before one atomic add per entry. The next
// window's tiles are copied by cp.async into a second set of shared tiles while the current one computes.
//
// Each warp owns a 16-row stripe of the (padded) 64 x 64 score matrix and keeps it in registers across mma.sync
// m16n8k16 instructions (FlashAttention-2's layout: an accumulator's (row, column) pairs are exactly those of the next
// product's A operand, so P and dS never leave registers for the products on the row side). Only the transposed
// products of the backward (P^T dO and dS^T Q) go through shared memory. The forward saves the row log-sum-exp; the
// backward recomputes P from it and takes the softmax's row term from P * dP, so the output is not needed.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kD = 32;            // head dim
constexpr int kNP = 64;           // tokens, padded to the tensor-core tile
constexpr int kWarps = kNP / 16;  // one warp per 16-row stripe
constexpr int kThreads = kWarps * 32;
constexpr int kTiles = kNP / 8;  // 8-column accumulator tiles across a score row
// Padded shared-memory strides (elements): 16-byte aligned rows whose 8-row ldmatrix reads hit distinct banks.
constexpr int kLdX = kD + 8;
constexpr int kLdP = kNP + 8;
// Float bias + mask (and bias gradient) tiles: a lane reads 8-byte column pairs, and a stride of 72 floats puts the
// 16 lanes of each half-warp (rows g = 0..3, pairs tig = 0..3) on 32 distinct banks.
constexpr int kLdB = kNP + 8;
constexpr int kVectors = kD / 8;  // 16-byte vectors per head row

constexpr int align128(int bytes) { return (bytes + 127) / 128 * 128; }
constexpr int kTileBytes = align128(kNP * kLdX * 2);
constexpr int kFullBytes = align128(kNP * kLdP * 2);
constexpr int kBiasBytes = align128(kNP * kLdB * 4);
constexpr int kForwardSmem = 6 * kTileBytes + kBiasBytes;  // two sets of q, k, v tiles, as in the backward
// The backward keeps two sets of q, k, v, dO tiles (one computes while the next window's copies land in the other), P
// and dS, and the additive tile for the kCols * 8 rows that can hold real tokens: 75,520 bytes for windows of 7, so
// that 3 blocks fit on an SM.
constexpr int backward_smem(int cols) { return 8 * kTileBytes + 2 * kFullBytes + align128(8 * cols * kLdB * 4); }
// The backward sums the table's gradient in its additive tile, at least 7 * 8 rows of kLdB floats.
constexpr int kMaxTableEntries = 7 * 8 * kLdB;

// ------------------------------------------------------------------ tensor-core building blocks

template <typename T>
__device__ __forceinline__ uint32_t pack(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// d += a (16 x 16, row-major fragment) @ b (16 x 8, column-major fragment), float accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of rows [r0, r0 + 16) x columns [c0, c0 + 16) of a row-major shared tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const void* tile, int ld, int r0, int c0, int elem) {
  const int lane = threadIdx.x % 32;
  const int r = r0 + lane % 8 + 8 * ((lane / 8) % 2), c = c0 + 8 * (lane / 16);
  ldmatrix_x4(a, static_cast<const char*>(tile) + (r * ld + c) * elem);
}

// The A fragment of the transpose: rows [r0, r0 + 16) of tile^T, its columns [c0, c0 + 16) (tile rows c0..).
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const void* tile, int ld, int r0, int c0,
                                                  int elem) {
  const int lane = threadIdx.x % 32;
  const int r = c0 + lane % 8 + 8 * (lane / 16), c = r0 + 8 * ((lane / 8) % 2);
  ldmatrix_x4_trans(a, static_cast<const char*>(tile) + (r * ld + c) * elem);
}

// B fragments of y^T for x @ y^T, y row-major (rows = the product's columns n): rows [n0, n0 + 8) of y, all kD
// columns. b[0], b[1] serve k in [0, 16), b[2], b[3] k in [16, 32).
__device__ __forceinline__ void load_b_of_transpose(uint32_t (&b)[4], const void* tile, int n0, int elem) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, static_cast<const char*>(tile) + ((n0 + lane % 8) * kLdX + 8 * (lane / 8)) * elem);
}

// B fragments for x @ y with y row-major (kNP x kD): k rows [k0, k0 + 16), columns [n0, n0 + 16): b[0], b[1] serve
// columns n0.., b[2], b[3] columns n0 + 8...
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const void* tile, int k0, int n0, int elem) {
  const int lane = threadIdx.x % 32;
  const int r = k0 + lane % 8 + 8 * ((lane / 8) % 2), c = n0 + 8 * (lane / 16);
  ldmatrix_x4_trans(b, static_cast<const char*>(tile) + (r * kLdX + c) * elem);
}

// acc[t] = rows [16w, 16w + 16) of x @ y^T, x and y (kNP x kD) shared tiles, for the kCols 8-column tiles that hold
// real columns; the tiles past them are zero (no logits there, and no probability).
template <typename T, int kCols>
__device__ __forceinline__ void scores(float (&acc)[kTiles][4], const T* x, const T* y, int warp) {
  uint32_t a[kD / 16][4];
#pragma unroll
  for (int s = 0; s < kD / 16; ++s) load_a(a[s], x, kLdX, 16 * warp, 16 * s, sizeof(T));
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    if (t >= kCols) continue;
    uint32_t b[4];
    load_b_of_transpose(b, y, 8 * t, sizeof(T));
    mma<T>(acc[t], a[0], b[0], b[1]);
    mma<T>(acc[t], a[1], b[2], b[3]);
  }
}

// The A fragments (4 k-steps over the score columns) of a 16 x kNP stripe held as accumulators.
template <typename T>
__device__ __forceinline__ void stripe_as_a(uint32_t (&a)[kNP / 16][4], const float (&acc)[kTiles][4]) {
#pragma unroll
  for (int s = 0; s < kNP / 16; ++s) {
    a[s][0] = pack<T>(acc[2 * s][0], acc[2 * s][1]);
    a[s][1] = pack<T>(acc[2 * s][2], acc[2 * s][3]);
    a[s][2] = pack<T>(acc[2 * s + 1][0], acc[2 * s + 1][1]);
    a[s][3] = pack<T>(acc[2 * s + 1][2], acc[2 * s + 1][3]);
  }
}

// out (16 x kD accumulators, 4 tiles of 8 columns) = a (16 x kNP, as 4 A fragments) @ y (kNP x kD shared tile).
template <typename T>
__device__ __forceinline__ void stripe_times(float (&out)[kD / 8][4], const uint32_t (&a)[kNP / 16][4], const T* y) {
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) out[n][0] = out[n][1] = out[n][2] = out[n][3] = 0.f;
#pragma unroll
  for (int s = 0; s < kNP / 16; ++s) {
#pragma unroll
    for (int n = 0; n < kD / 16; ++n) {
      uint32_t b[4];
      load_b(b, y, 16 * s, 16 * n, sizeof(T));
      mma<T>(out[2 * n], a[s], b[0], b[1]);
      mma<T>(out[2 * n + 1], a[s], b[2], b[3]);
    }
  }
}

// A warp's 16 x kD accumulators to global rows i0 + g and i0 + g + 8 (those < N), times `factor`.
template <typename T>
__device__ __forceinline__ void store_rows(const float (&acc)[kD / 8][4], T* dst, int64_t row_stride, int i0, int N,
                                           float factor) {
  const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = i0 + g + 8 * half;
    if (i >= N) continue;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + i * row_stride + 8 * n + 2 * tig) =
          pack<T>(acc[n][2 * half] * factor, acc[n][2 * half + 1] * factor);
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 1);
  return v + __shfl_xor_sync(0xffffffff, v, 2);
}

// Logits are kept in base 2 (scale and the additive term carry log2(e)), so each probability is one ex2.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The kNP x kNP tile's elements are walked in batches of kBatch per thread, element e = threadIdx.x + r * kThreads of
// batch `first` at r = first, ..., first + kBatch - 1 (row e / kNP, column e % kNP). The prologue that reads them runs
// once per block and is bound by latency: a batch issues all its index reads, then the reads that depend on them, so
// a thread waits twice per batch instead of twice per element.
constexpr int kBatch = 8, kBatches = kNP * kNP / kThreads / kBatch;

// The table entries of one batch, -1 in the padding.
__device__ __forceinline__ void table_entries(int (&entry)[kBatch], const int64_t* index, int N, int first) {
#pragma unroll
  for (int r = 0; r < kBatch; ++r) {
    const int e = threadIdx.x + (first + r) * kThreads, i = e / kNP, j = e % kNP;
    entry[r] = i < N && j < N ? static_cast<int>(index[i * N + j]) : -1;
  }
}

// The block's additive term for every logit (kNP x kLdB floats, base 2): head h's bias, table[index[i, j], h], plus
// the shift mask at window position w, the same for every window the block walks; -inf outside N x N, so padded
// columns get probability 0. Only the tile's first `rows` rows are written.
__device__ void load_bias_mask(float* tile, int rows, const float* table, const int64_t* index, const float* mask,
                               int h, int heads, int w, int N) {
#pragma unroll 1
  for (int first = 0; first < kBatches * kBatch; first += kBatch) {
    int entry[kBatch];
    table_entries(entry, index, N, first);
    float value[kBatch];  // all loads, then all stores, so that no load waits behind a store
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const int e = threadIdx.x + (first + r) * kThreads, i = e / kNP, j = e % kNP;
      value[r] = entry[r] < 0 ? -INFINITY
                              : (table[entry[r] * heads + h] + (mask ? mask[(w * N + i) * N + j] : 0.f)) * kLog2e;
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const int e = threadIdx.x + (first + r) * kThreads;
      if (e / kNP < rows) tile[(e / kNP) * kLdB + e % kNP] = value[r];
    }
  }
}

// Rows [N, kNP) of `count` consecutive tiles are zero for the whole kernel: the windows only ever write rows < N.
template <typename T>
__device__ void zero_padding_rows(T* tiles, int count, int N) {
  for (int e = threadIdx.x; e < count * (kNP - N) * kVectors; e += kThreads) {
    const int m = e / ((kNP - N) * kVectors), r = N + (e / kVectors) % (kNP - N), c = (e % kVectors) * 8;
    *reinterpret_cast<uint4*>(tiles + m * (kTileBytes / sizeof(T)) + r * kLdX + c) = make_uint4(0, 0, 0, 0);
  }
}

// This lane's two adjacent columns of accumulator tile t in row i of a kNP x kLdB float tile.
__device__ __forceinline__ float2* pair_at(float* tile, int i, int t) {
  return reinterpret_cast<float2*>(tile + i * kLdB + 8 * t + 2 * (threadIdx.x % 4));
}

__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// `kCount` head tiles of one window, rows [0, N), from global to shared memory by cp.async, without passing through
// registers (the padding rows stay zero). Row r of matrix m starts at src + m * matrix_offset + r * row_stride.
template <int kCount, typename T>
__device__ void copy_tiles_async(T* tiles, const T* src, int64_t matrix_offset, int64_t row_stride, int N) {
  constexpr int kPerThread = kCount * kNP * kVectors / kThreads;
  static_assert(kCount * kNP * kVectors % kThreads == 0, "tiles must split evenly over the threads");
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int v = threadIdx.x + e * kThreads;
    const int m = v / (kNP * kVectors), r = (v / kVectors) % kNP, c = (v % kVectors) * 8;
    if (r < N) {
      copy_async16(tiles + m * (kTileBytes / sizeof(T)) + r * kLdX + c, src + m * matrix_offset + r * row_stride + c);
    }
  }
}

// ------------------------------------------------------------------ the kernels
// Lane roles in an accumulator: g = lane / 4 picks rows 16w + g and 16w + g + 8, tig = lane % 4 picks columns
// 8t + 2 tig and 8t + 2 tig + 1 of every 8-column tile t.

template <typename T, int kCols>
__global__ void __launch_bounds__(kThreads, 4) window_attention_forward_kernel(
    const T* __restrict__ qkv, T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ table,
    const int64_t* __restrict__ index, const float* __restrict__ mask, int64_t windows, int n_mask, int heads, int N,
    float scale) {
  constexpr int kTile = kTileBytes / sizeof(T);
  extern __shared__ __align__(128) unsigned char smem[];
  T* tiles = reinterpret_cast<T*>(smem);  // set s: q, k, v at tiles + (3 s + 0..2) * kTile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4, h = blockIdx.y;
  float* add = reinterpret_cast<float*>(smem + 6 * kTileBytes);
  const int C = heads * kD, rows[2] = {16 * warp + g, 16 * warp + g + 8};
  const float scale2 = scale * kLog2e;
  load_bias_mask(add, kNP, table, index, mask, h, heads, blockIdx.x % n_mask, N);
  zero_padding_rows(tiles, 6, N);
  int set = 0;
  int64_t b = blockIdx.x;
  if (b < windows) {
    copy_tiles_async<3>(tiles, qkv + b * N * 3 * C + h * kD, C, 3 * C, N);
    copy_async_commit();
  }
  for (; b < windows; b += gridDim.x, set ^= 1) {
    const T* q = tiles + 3 * set * kTile;
    const T *k = q + kTile, *v = q + 2 * kTile;
    copy_async_wait();
    __syncthreads();  // this window's tiles are in, and every warp is done with the other set
    if (b + gridDim.x < windows) {
      copy_tiles_async<3>(tiles + 3 * (set ^ 1) * kTile, qkv + (b + gridDim.x) * N * 3 * C + h * kD, C, 3 * C, N);
      copy_async_commit();
    }
    float s[kTiles][4];
    scores<T, kCols>(s, q, k, warp);
    float top[2] = {-INFINITY, -INFINITY}, total[2] = {0.f, 0.f};
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 term = *pair_at(add, rows[half], t);
        s[t][2 * half] = fmaf(s[t][2 * half], scale2, term.x);
        s[t][2 * half + 1] = fmaf(s[t][2 * half + 1], scale2, term.y);
        top[half] = fmaxf(top[half], fmaxf(s[t][2 * half], s[t][2 * half + 1]));
      }
    }
    top[0] = quad_max(top[0]);
    top[1] = quad_max(top[1]);
    // A padded row is all -inf: give it probability 0 instead of NaN.
    const float shift[2] = {rows[0] < N ? top[0] : INFINITY, rows[1] < N ? top[1] : INFINITY};
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[t][e] = exp2_approx(s[t][e] - shift[e / 2]);
        total[e / 2] += s[t][e];
      }
    }
    total[0] = quad_sum(total[0]);
    total[1] = quad_sum(total[1]);
    const float inv[2] = {rows[0] < N ? 1.f / total[0] : 0.f, rows[1] < N ? 1.f / total[1] : 0.f};
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] *= inv[e / 2];
    }
    uint32_t p[kNP / 16][4];
    stripe_as_a<T>(p, s);
    float o[kD / 8][4];
    stripe_times(o, p, v);
    store_rows(o, out + b * N * C + h * kD, C, 16 * warp, N, 1.f);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (tig == 0 && rows[half] < N) {
        lse[(b * heads + h) * N + rows[half]] = (top[half] + __log2f(total[half])) * kLn2;  // natural log
      }
    }
  }
}

template <typename T, int kCols>
__global__ void __launch_bounds__(kThreads, 3) window_attention_backward_kernel(
    const T* __restrict__ grad_out, const T* __restrict__ qkv, const float* __restrict__ lse, T* __restrict__ grad_qkv,
    float* __restrict__ grad_table, const float* __restrict__ table, const int64_t* __restrict__ index,
    const float* __restrict__ mask, int64_t windows, int n_mask, int heads, int N, int entries, float scale) {
  constexpr int kTile = kTileBytes / sizeof(T);
  extern __shared__ __align__(128) unsigned char smem[];
  T* tiles = reinterpret_cast<T*>(smem);  // set s: q, k, v, dO at tiles + (4 s + 0..3) * kTile
  T* probs = reinterpret_cast<T*>(smem + 8 * kTileBytes);
  T* dscores = reinterpret_cast<T*>(smem + 8 * kTileBytes + kFullBytes);
  float* add = reinterpret_cast<float*>(smem + 8 * kTileBytes + 2 * kFullBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4, h = blockIdx.y;
  const int C = heads * kD, rows[2] = {16 * warp + g, 16 * warp + g + 8};
  // Rows past the additive tile are padding (probability 0 whatever they add), so they read the last real row.
  const int add_rows[2] = {min(rows[0], N - 1), min(rows[1], N - 1)};
  const float scale2 = scale * kLog2e;
  load_bias_mask(add, 8 * kCols, table, index, mask, h, heads, blockIdx.x % n_mask, N);
  zero_padding_rows(tiles, 8, N);
  float next_lse[2];  // base 2; +inf on padded rows makes their probabilities 0
  const auto fetch = [&](int64_t w, int set) {
    copy_tiles_async<3>(tiles + 4 * set * kTile, qkv + w * N * 3 * C + h * kD, C, 3 * C, N);
    copy_tiles_async<1>(tiles + (4 * set + 3) * kTile, grad_out + w * N * C + h * kD, 0, C, N);
    copy_async_commit();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      next_lse[half] = rows[half] < N ? lse[(w * heads + h) * N + rows[half]] * kLog2e : INFINITY;
    }
  };
  // This lane's bias-gradient sums over the block's windows, at its accumulator positions.
  float2 sums[kCols][2];
#pragma unroll
  for (int t = 0; t < kCols; ++t) sums[t][0] = sums[t][1] = make_float2(0.f, 0.f);
  int set = 0;
  int64_t b = blockIdx.x;
  if (b < windows) fetch(b, 0);
  for (; b < windows; b += gridDim.x, set ^= 1) {
    const T* q = tiles + 4 * set * kTile;
    const T *k = q + kTile, *v = q + 2 * kTile, *dout = q + 3 * kTile;
    const float row_lse[2] = {next_lse[0], next_lse[1]};
    copy_async_wait();
    // This window's tiles are in, and every warp is done with the previous window's: its tile set, P and dS.
    __syncthreads();
    if (b + gridDim.x < windows) fetch(b + gridDim.x, set ^ 1);
    float p[kTiles][4], ds[kTiles][4];
    scores<T, kCols>(p, q, k, warp);
    scores<T, kCols>(ds, dout, v, warp);  // dP = dO V^T, turned into dS below
    float dot[2] = {0.f, 0.f};
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 term = *pair_at(add, add_rows[half], t);
        p[t][2 * half] = exp2_approx(fmaf(p[t][2 * half], scale2, term.x) - row_lse[half]);
        p[t][2 * half + 1] = exp2_approx(fmaf(p[t][2 * half + 1], scale2, term.y) - row_lse[half]);
        dot[half] += p[t][2 * half] * ds[t][2 * half] + p[t][2 * half + 1] * ds[t][2 * half + 1];
      }
    }
    dot[0] = quad_sum(dot[0]);
    dot[1] = quad_sum(dot[1]);
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[t][e] = p[t][e] * (ds[t][e] - dot[e / 2]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        sums[t][half].x += ds[t][2 * half];
        sums[t][half].y += ds[t][2 * half + 1];
        const int at = rows[half] * kLdP + 8 * t + 2 * tig;
        *reinterpret_cast<uint32_t*>(probs + at) = pack<T>(p[t][2 * half], p[t][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(dscores + at) = pack<T>(ds[t][2 * half], ds[t][2 * half + 1]);
      }
    }
    // dQ = dS K * scale, this warp's rows, from the registers.
    uint32_t a[kNP / 16][4];
    stripe_as_a<T>(a, ds);
    float acc[kD / 8][4];
    stripe_times(acc, a, k);
    store_rows(acc, grad_qkv + b * N * 3 * C + h * kD, 3 * C, 16 * warp, N, scale);
    __syncthreads();  // every warp's rows of P and dS are in
    // dV = P^T dO and dK = dS^T Q * scale, this warp's rows j: column stripes of P and dS, read transposed. Columns of
    // P and dS past kCols tiles were never written: they only reach rows j >= N of dV and dK, which are not stored.
#pragma unroll
    for (int s = 0; s < kNP / 16; ++s) load_a_transposed(a[s], probs, kLdP, 16 * warp, 16 * s, sizeof(T));
    stripe_times(acc, a, dout);
    store_rows(acc, grad_qkv + b * N * 3 * C + 2 * C + h * kD, 3 * C, 16 * warp, N, 1.f);
#pragma unroll
    for (int s = 0; s < kNP / 16; ++s) load_a_transposed(a[s], dscores, kLdP, 16 * warp, 16 * s, sizeof(T));
    stripe_times(acc, a, q);
    store_rows(acc, grad_qkv + b * N * 3 * C + C + h * kD, 3 * C, 16 * warp, N, scale);
  }
  // The lanes' sums are added up per table entry in shared memory (the additive tile is free once every warp is past
  // its last window), so the block makes one global atomic add per entry: (2w-1)^2 of them instead of N^2.
  __syncthreads();
  float* entry_sums = add;
  for (int t = threadIdx.x; t < entries; t += kThreads) entry_sums[t] = 0.f;
  __syncthreads();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (rows[half] >= N) continue;
    int entry[kCols][2];  // all index reads first: each atomic add waits on its own
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int j = 8 * t + 2 * tig + c;
        entry[t][c] = j < N ? static_cast<int>(index[rows[half] * N + j]) : -1;
      }
    }
#pragma unroll
    for (int t = 0; t < kCols; ++t) {
      if (entry[t][0] >= 0) atomicAdd(entry_sums + entry[t][0], sums[t][half].x);
      if (entry[t][1] >= 0) atomicAdd(entry_sums + entry[t][1], sums[t][half].y);
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < entries; t += kThreads) atomicAdd(grad_table + t * heads + h, entry_sums[t]);
}

struct Launch {
  dim3 grid;
  int smem;
};

// One block per (window chunk, head), as many as fit on the GPU at once: every block gets the same number of windows,
// so one wave has no tail, and each block pays its bias load and the backward's atomic adds once for many windows.
// The chunk count is a multiple of the mask's nW so that every window a block walks sits at the same mask position.
// The kernel is a template argument so that each kernel (not each kernel signature) gets its own static setup.
template <auto kernel>
Launch plan(int smem, int64_t windows, int heads, int n_mask) {
  static const int per_sm = [&] {  // once per kernel: the launch path runs 48 times a Swin-B step
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));  // past 48 KiB
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem));
    return std::max(blocks, 1);
  }();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t target = per_sm * sms;
  const int64_t wanted = std::min<int64_t>((windows + 3) / 4, target / heads);
  const int64_t chunks = std::max<int64_t>(1, wanted / n_mask) * n_mask;  // windows is a multiple of n_mask
  return {dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(heads)), smem};
}

// The index's values must lie in [0, entries): they come from the model's relative-position index, and checking
// them here would cost a device sync per call.
void check_inputs(const torch::Tensor& qkv, const torch::Tensor& table, const torch::Tensor& index,
                  const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(qkv.is_cuda() && qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous CUDA (B_, N, 3C)");
  TORCH_CHECK(qkv.scalar_type() == at::kHalf || qkv.scalar_type() == at::kBFloat16, "qkv must be half or bfloat16");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous() &&
                  table.size(0) <= kMaxTableEntries,
              "bias table must be contiguous float (entries <= ", kMaxTableEntries, ", heads), got ", table.sizes());
  const int64_t N = qkv.size(1), heads = table.size(1);
  TORCH_CHECK(N >= 1 && N <= kNP && qkv.size(2) == 3 * heads * kD, "fused window attention takes 1 <= N <= ", kNP,
              " and head dim ", kD, ", got ", qkv.sizes(), " with ", heads, " heads");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == N && index.size(1) == N && index.scalar_type() == at::kLong &&
                  index.is_contiguous() && index.device() == qkv.device(),
              "bias index must be contiguous int64 (N, N) on qkv's device, got ", index.sizes());
  if (mask) {
    TORCH_CHECK(mask->dim() == 3 && mask->size(1) == N && mask->size(2) == N && mask->scalar_type() == at::kFloat &&
                    mask->is_contiguous() && qkv.size(0) % mask->size(0) == 0,
                "shift mask must be contiguous float (nW, N, N), got ", mask->sizes());
  }
}

// Runs `run` with a null pointer of the element type and the count of 8-column score tiles that hold real columns: 7
// for windows of 7 (N = 49), which skips the last tile's products, else all 8.
template <typename Run>
void dispatch(const torch::Tensor& qkv, Run run) {
  const bool seven = qkv.size(1) <= 7 * 8;
  if (qkv.scalar_type() == at::kHalf) {
    if (seven) run(static_cast<__half*>(nullptr), std::integral_constant<int, 7>());
    else run(static_cast<__half*>(nullptr), std::integral_constant<int, 8>());
  } else {
    if (seven) run(static_cast<__nv_bfloat16*>(nullptr), std::integral_constant<int, 7>());
    else run(static_cast<__nv_bfloat16*>(nullptr), std::integral_constant<int, 8>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::vector<torch::Tensor> window_attention_forward_cuda(const torch::Tensor& qkv, const torch::Tensor& table,
                                                         const torch::Tensor& index,
                                                         const c10::optional<torch::Tensor>& mask, double scale) {
  check_inputs(qkv, table, index, mask);
  c10::cuda::CUDAGuard guard(qkv.device());
  const int64_t windows = qkv.size(0), N = qkv.size(1), heads = table.size(1), n_mask = mask ? mask->size(0) : 1;
  auto out = torch::empty({windows, N, heads * kD}, qkv.options());
  auto lse = torch::empty({windows, heads, N}, qkv.options().dtype(torch::kFloat));
  if (windows == 0) return {out, lse};
  dispatch(qkv, [&](auto* type, auto cols) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr auto kernel = window_attention_forward_kernel<T, decltype(cols)::value>;
    const Launch launch = plan<kernel>(kForwardSmem, windows, heads, n_mask);
    kernel<<<launch.grid, kThreads, launch.smem, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const T*>(qkv.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>(),
        table.data_ptr<float>(), index.data_ptr<int64_t>(), mask ? mask->data_ptr<float>() : nullptr, windows,
        n_mask, heads, N, static_cast<float>(scale));
  });
  return {out, lse};
}

std::vector<torch::Tensor> window_attention_backward_cuda(const torch::Tensor& grad_out, const torch::Tensor& qkv,
                                                          const torch::Tensor& lse, const torch::Tensor& table,
                                                          const torch::Tensor& index,
                                                          const c10::optional<torch::Tensor>& mask, double scale) {
  check_inputs(qkv, table, index, mask);
  c10::cuda::CUDAGuard guard(qkv.device());
  const int64_t windows = qkv.size(0), N = qkv.size(1), heads = table.size(1), n_mask = mask ? mask->size(0) : 1;
  TORCH_CHECK(grad_out.sizes() == torch::IntArrayRef({windows, N, heads * kD}) && grad_out.is_contiguous() &&
                  grad_out.scalar_type() == qkv.scalar_type(),
              "output gradient must be contiguous (", windows, ", ", N, ", ", heads * kD, ") in qkv's dtype");
  TORCH_CHECK(lse.sizes() == torch::IntArrayRef({windows, heads, N}) && lse.is_contiguous(), "bad log-sum-exp");
  auto grad_qkv = torch::empty_like(qkv);
  auto grad_table = torch::zeros_like(table);
  if (windows == 0) return {grad_qkv, grad_table};
  dispatch(qkv, [&](auto* type, auto cols) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr auto kernel = window_attention_backward_kernel<T, decltype(cols)::value>;
    const Launch launch = plan<kernel>(backward_smem(decltype(cols)::value), windows, heads, n_mask);
    kernel<<<launch.grid, kThreads, launch.smem, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const T*>(grad_out.data_ptr()), reinterpret_cast<const T*>(qkv.data_ptr()),
        lse.data_ptr<float>(), reinterpret_cast<T*>(grad_qkv.data_ptr()), grad_table.data_ptr<float>(),
        table.data_ptr<float>(), index.data_ptr<int64_t>(), mask ? mask->data_ptr<float>() : nullptr, windows,
        n_mask, heads, N, static_cast<int>(table.size(0)), static_cast<float>(scale));
  });
  return {grad_qkv, grad_table};
}

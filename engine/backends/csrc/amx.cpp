// AMX tiles for the decoder's matmuls (Sapphire Rapids and later): the weights packed as B tiles in the order a
// step reads them, the step's 1-32 input rows as A tiles read in place.
#include "kernels.h"
#include "amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

namespace peregrine {
namespace {

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  __asm__ __volatile__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
}

}  // namespace

bool amx_tiles_permitted() {
  // Linux hands the AMX tile state to a process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

bool amx_available() { return cpu_has_amx_bf16() && amx_tiles_permitted(); }

namespace {

// Tiles: 0-3 accumulators C[m block][n block] (up to 16 input rows x 16 float32), 4-5 weights B (16 k-pairs x 16
// weight rows x 2 bf16), 6-7 inputs A (up to 16 input rows x 32 bf16). The A and C tiles hold exactly the pass's
// input rows, so nothing past the last row is read and no padded copy of the inputs is made.
void load_tile_config(int64_t rows) {
  TileConfig cfg;
  const uint8_t first = static_cast<uint8_t>(std::min<int64_t>(rows, 16)),
                second = static_cast<uint8_t>(rows > 16 ? rows - 16 : 16);
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[0] = cfg.rows[2] = cfg.rows[6] = first;
  cfg.rows[1] = cfg.rows[3] = cfg.rows[7] = second;
  _tile_loadconfig(&cfg);
}

constexpr int64_t kMPass = 32;          // input rows per pass over the weights (two A tiles)

}  // namespace

// The weights as AMX reads them: per block of 32 rows (16 for a last odd block), for each 32-column step, the block's
// 1 or 2 B tiles ([16 k-pairs][16 rows][2 bf16], 1 KB each). A matmul then reads its weights strictly front to
// back, which the hardware prefetchers and one software prefetch a fixed distance ahead keep streaming. The block
// of rows [n, n + 32) starts at n * K, as in the [N, K] layout.
void pack_weight(const uint16_t* w, int64_t N, int64_t K, uint16_t* dst) {
  at::parallel_for(0, (N + 31) / 32, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * 32, count = n + 32 <= N ? 2 : 1;
      uint16_t* block = dst + n * K;
      for (int64_t kb = 0; kb < K / 32; ++kb)
        for (int64_t i = 0; i < count; ++i)
          for (int64_t p = 0; p < 16; ++p)
            for (int64_t j = 0; j < 16; ++j)
              for (int64_t e = 0; e < 2; ++e)
                block[((kb * count + i) * 16 + p) * 32 + j * 2 + e] = w[(n + i * 16 + j) * K + kb * 32 + p * 2 + e];
    }
  });
}

namespace {

// C tiles for the packed block of `count` (1-2) x 16 weight rows at `wb` against input rows x (A tiles, stride ldx).
template <bool TWO_M>
void amx_block(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t K, int64_t count, float* c) {
  _tile_zero(0);
  _tile_zero(2);
  if (TWO_M) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint16_t* tiles = wb + kb * count * 512;
    const char* ahead = reinterpret_cast<const char*>(tiles) + kAheadBytes;
    for (int64_t line = 0; line < count * 16; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    _tile_loadd(6, x + kb * 32, ldx * 2);
    if (TWO_M) _tile_loadd(7, x + 16 * ldx + kb * 32, ldx * 2);
    _tile_loadd(4, tiles, 64);
    _tile_dpbf16ps(0, 6, 4);
    if (TWO_M) _tile_dpbf16ps(1, 7, 4);
    if (count == 2) {
      _tile_loadd(5, tiles + 512, 64);
      _tile_dpbf16ps(2, 6, 5);
      if (TWO_M) _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, c, 64);
  if (TWO_M) _tile_stored(1, c + 256, 64);
  if (count == 2) {
    _tile_stored(2, c + 512, 64);
    if (TWO_M) _tile_stored(3, c + 768, 64);
  }
}

// out[m, n:n+16] for one accumulator tile c ([rows][16]): + bias, rounded to bfloat16 (round to nearest even).
inline void store_tile(const float* c, const float* bias, int64_t n, int64_t m0, int64_t rows, bf16* out, int64_t ldo) {
  const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + m * 16), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * ldo + n), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

}  // namespace

void amx_rows(const uint16_t* packed, int64_t N, int64_t K, const float* bias, const uint16_t* xs, int64_t ldx,
              int64_t M, bf16* out, int64_t ldo, int64_t n_begin, int64_t n_end, AmxScratch& s) {
  for (int64_t m0 = 0; m0 < M; m0 += kMPass) {
    const int64_t mb = std::min<int64_t>(M - m0, kMPass);
    if (s.tile_rows != mb) {
      load_tile_config(mb);
      s.tile_rows = mb;
    }
    for (int64_t n = n_begin; n < n_end; n += 32) {
      const int64_t count = n + 32 <= N ? 2 : 1;
      if (mb > 16) amx_block<true>(xs + m0 * ldx, ldx, packed + n * K, K, count, s.c);
      else amx_block<false>(xs + m0 * ldx, ldx, packed + n * K, K, count, s.c);
      for (int64_t i = 0; i < count; ++i) {
        store_tile(s.c + i * 512, bias, n + i * 16, m0, std::min<int64_t>(mb, 16), out, ldo);
        if (mb > 16) store_tile(s.c + i * 512 + 256, bias, n + i * 16, m0 + 16, mb - 16, out, ldo);
      }
    }
  }
}

void amx_release() { _tile_release(); }

}  // namespace peregrine

#else  // a build without AMX: the decoder never asks for it

namespace peregrine {

bool amx_available() { return false; }
void pack_weight(const uint16_t*, int64_t, int64_t, uint16_t*) { TORCH_CHECK(false, "this build has no AMX"); }
void amx_rows(const uint16_t*, int64_t, int64_t, const float*, const uint16_t*, int64_t, int64_t, bf16*, int64_t,
              int64_t, int64_t, AmxScratch&) {
  TORCH_CHECK(false, "this build has no AMX");
}
void amx_release() {}

}  // namespace peregrine

#endif

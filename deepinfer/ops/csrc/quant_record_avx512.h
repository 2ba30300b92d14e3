// Reading quant_linear.cpp's packed records with AVX-512 (see the layout at its top): the per-lane scales and a
// 4- or 5-bit record's 64-byte pieces as bytes. Shared by the int8 tiles (quant_tile_avx512.h) and the AMX
// dequantization (amx_dequant.h); included inside quant_linear.cpp's anonymous namespace, at file scope elsewhere.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// 16 lanes of scales or offsets, float16 bits or float32.
template <typename ST> inline __m512 load16(const ST* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<uint16_t>(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 64 fifth bits of a 5-bit record's register of nibbles as a byte mask.
inline __mmask64 fifth_bits(const uint8_t* p) {
  uint64_t m;
  std::memcpy(&m, p, 8);
  return _cvtu64_mask64(m);
}

// Piece p of a 4- or 5-bit group record (32 values) as the bytes of the 8-bit layout's pieces 2p (lo: k = 8p..8p+3
// of each lane) and 2p + 1 (hi: k = 8p+4..8p+7): the nibbles, + 16 where a 5-bit record's fifth bit is set.
template <int BITS>
__attribute__((always_inline)) inline void piece_quants(const uint8_t* rec, int p, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F), w = _mm512_loadu_si512(rec + 64 * p);
  lo = _mm512_and_si512(w, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
  if constexpr (BITS == 5) {  // a masked byte add
    const __m512i sixteen = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, fifth_bits(rec + 256 + 16 * p), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, fifth_bits(rec + 256 + 16 * p + 8), hi, sixteen);
  }
}

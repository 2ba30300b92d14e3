// 32 bits as 32 bytes (AVX2), for quant_tile_avx2.h's 5-bit records and split_planes.h's bit planes.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// The 32 bits at p (bit i % 8 of byte i / 8 for byte i) as `value` in each byte whose bit is set, 0 elsewhere: byte i
// takes byte i / 8 (a shuffle within each 128-bit lane) and tests bit i % 8.
inline __m256i bit_bytes(const uint8_t* p, char value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  int32_t m;
  std::memcpy(&m, p, 4);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(m), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(value));
}

// float8 e4m3fn cache values widened to float32 (attention.cpp's loops; the rounding into the cache is cache_row's).
// The 7 bits below the sign, moved to a float32's exponent and mantissa (bits 20..26) and multiplied by 2^120 (the
// difference of the two exponent biases, 127 - 7), give the value exactly, subnormals included; then the sign. A
// cache holds no NaN (a NaN key or value would poison every score anyway).
#pragma once
#include <cstdint>
#include <cstring>

static inline float fp8_value(uint8_t x) {
  const uint32_t low = (uint32_t)(x & 0x7Fu) << 20;
  float f;
  std::memcpy(&f, &low, 4);
  f *= 0x1p120f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= (uint32_t)(x & 0x80u) << 24;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
// 16 e4m3fn bytes -> 16 float32: sign-extended, shifted by 20 and masked, the sign lands on bit 31 and the 7 bits
// below it on bits 20..26 (four operations, the bfloat16 row's two plus a mask and the multiply)
static inline __m512 fp8_widen16(const uint8_t* p) {
  const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(x, 20), _mm512_set1_epi32((int)0x87F00000u));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}
#elif defined(__AVX2__)
#include <immintrin.h>
// 8 e4m3fn bytes -> 8 float32 (as fp8_widen16)
static inline __m256 fp8_widen8(const uint8_t* p) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32((int)0x87F00000u));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}
#endif

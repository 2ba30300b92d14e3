// Part of split_head.cpp, included there inside its anonymous namespace: reading the planes (kHigh, kLow, kWide,
// kAhead and SplitView from there) back into the 8-bit records, in registers (Unpack, AVX-512) or to memory (widen).

#if defined(__AVX2__)
// The planes stream from memory: ask for the lines kAhead groups on (into the next block's at a block's end).
inline void prefetch_planes(const uint8_t* h, const uint8_t* l) {
  for (int line = 0; line < kHigh; line += 64) _mm_prefetch(reinterpret_cast<const char*>(h + kAhead * kHigh + line), _MM_HINT_T0);
  for (int line = 0; line < kLow; line += 64) _mm_prefetch(reinterpret_cast<const char*>(l + kAhead * kLow + line), _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)

// The 8-bit records' registers of one group, r = 0..7, from its high record h and low planes l.
struct Unpack {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
#if defined(__GFNI__) && defined(__AVX512VBMI__)
  // u = (nibble << 3) | (fifth << 7) | l, the last two from one bit transpose: qword q of the register gets the
  // low planes' bytes q at bytes 7, 6, 5 and the fifth bits' byte q at byte 0 (vpermt2b); gf2p8affineqb with byte j
  // of the selector 1 << j makes bit i of byte j bit j of byte 7 - i: byte j = l | fifth << 7 of value 8q + j
  const __m512i select = _mm512_set1_epi64(0x8040201008040201ll), middle = _mm512_set1_epi8(0x78);
  __m512i index;
  Unpack() {
    alignas(64) uint8_t at[64];
    for (int q = 0; q < 8; ++q)
      for (int i = 0; i < 8; ++i) at[8 * q + i] = i == 7 ? q : i == 6 ? 8 + q : i == 5 ? 16 + q : i == 0 ? 64 + q : 0;
    index = _mm512_load_si512(at);
  }
  // registers 2p and 2p + 1
  template <class F>
  __attribute__((always_inline)) void piece(const uint8_t* h, const uint8_t* l, int p, F&& use) const {
    const __m512i v = _mm512_loadu_si512(h + 64 * p);
    const __m512i shifted[2] = {_mm512_slli_epi16(v, 3), _mm512_srli_epi16(v, 1)};  // each nibble to bits 3..6
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * p + half;
      const __m512i planes = _mm512_maskz_loadu_epi8(0xFFFFFFull, l + 24 * r);
      const __m512i fifth = _mm512_maskz_loadu_epi8(0xFFull, h + 256 + 8 * r);
      const __m512i spread = _mm512_maskz_permutex2var_epi8(0xE1E1E1E1E1E1E1E1ull, planes, index, fifth);
      const __m512i low = _mm512_gf2p8affine_epi64_epi8(select, spread, 0);
      use(r, _mm512_ternarylogic_epi32(shifted[half], middle, low, 0xEA));  // (shifted & middle) | low
    }
  }
#else
  const __m512i sixteen = _mm512_set1_epi8(16);
  static __mmask64 mask(const uint8_t* p) {
    uint64_t m;
    std::memcpy(&m, p, 8);
    return _cvtu64_mask64(m);
  }
  // registers 2p and 2p + 1
  template <class F>
  __attribute__((always_inline)) void piece(const uint8_t* h, const uint8_t* l, int p, F&& use) const {
    const __m512i v = _mm512_loadu_si512(h + 64 * p);
    const __m512i reg[2] = {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * p + half;
      __m512i u = _mm512_mask_add_epi8(reg[half], mask(h + 256 + 16 * p + 8 * half), reg[half], sixteen);
      u = _mm512_slli_epi16(u, 3);  // bytes <= 31: no bit crosses into the next byte
      for (int t = 0; t < 3; ++t) u = _mm512_mask_add_epi8(u, mask(l + 24 * r + 8 * t), u, _mm512_set1_epi8(1 << t));
      use(r, u);
    }
  }
#endif
};
#endif

// Byte i of register r of a group's 8-bit record, from its high record h and low planes l (the portable reading).
inline uint8_t quant_at(const uint8_t* h, const uint8_t* l, int r, int i) {
  const int p = r / 2, half = r % 2;
  const int nib = half ? h[64 * p + i] >> 4 : h[64 * p + i] & 0x0F;
  const int fifth = (h[256 + 16 * p + 8 * half + i / 8] >> (i % 8)) & 1;
  int lo = 0;
  for (int t = 0; t < 3; ++t) lo |= ((l[24 * r + 8 * t + i / 8] >> (i % 8)) & 1) << t;
  return (uint8_t)(8 * (nib + 16 * fifth) + lo);
}

// Block b's 8-bit records: u = 8 * h + l.
void widen(const SplitView& w, int64_t b, uint8_t* out) {
  const uint8_t* h = w.high + b * w.ng * kHigh;
  const uint8_t* l = w.low + b * w.ng * kLow;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const Unpack un;
  for (int64_t g = 0; g < w.ng; ++g, h += kHigh, l += kLow, out += kWide) {
    prefetch_planes(h, l);
    for (int p = 0; p < 4; ++p) un.piece(h, l, p, [&](int r, __m512i u) { _mm512_storeu_si512(out + 64 * r, u); });
  }
#elif defined(__AVX2__)
  // per 32 bytes of a register: the nibbles, then + 16 where the fifth bit is set, times 8, + 2^t where low plane t's
  // bit is set (each a byte per bit: bit_bytes_avx2.h)
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < w.ng; ++g, h += kHigh, l += kLow, out += kWide) {
    prefetch_planes(h, l);
    for (int p = 0; p < 4; ++p)
      for (int half = 0; half < 2; ++half) {  // bytes 32 * half.. of registers 2p (low nibbles) and 2p + 1 (high)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 64 * p + 32 * half));
        const __m256i nib[2] = {_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
        for (int s = 0; s < 2; ++s) {
          const int r = 2 * p + s;
          __m256i u = _mm256_or_si256(nib[s], bit_bytes(h + 256 + 16 * p + 8 * s + 4 * half, 16));
          u = _mm256_slli_epi16(u, 3);  // bytes <= 31: no bit crosses into the next byte
          for (int t = 0; t < 3; ++t) u = _mm256_or_si256(u, bit_bytes(l + 24 * r + 8 * t + 4 * half, (char)(1 << t)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * r + 32 * half), u);
        }
      }
  }
#else
  for (int64_t g = 0; g < w.ng; ++g, h += kHigh, l += kLow, out += kWide)
    for (int r = 0; r < 8; ++r)
      for (int i = 0; i < 64; ++i) out[64 * r + i] = quant_at(h, l, r, i);
#endif
}

// Part of quant_linear.cpp, included there inside its anonymous namespace when the build has AVX2 but not
// AVX-512 VNNI: tile() for AVX2, with AVX-VNNI's dpbusd or with maddubs; without VNNI also tile_wide (16 lanes a
// pass; byte records of small quants without the sign flip) and widen5 (5-bit records as bytes, for many rows). They use load_i32, group_xsum, group_term and
// prefetch_ahead from quant_linear.cpp and follow the record layout and arithmetic described at its top.
template <typename ST> inline __m256 load8(const ST* p);
template <> inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<uint16_t>(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Integer dot products without VNNI, the exact int32 sums VNNI's dpbusd gives. maddubs multiplies u8 by s8 and
// adds pairs into saturating int16:
// - 4-bit quants (0..15): a pair is at most 2 * 15 * 127 = 3810, so four pieces' products (8 maddubs, <= 30480) add
//   up in int16 before one madd widens them; 5-bit quants (0..31, a pair <= 7874): two pieces (<= 31496);
// - 8-bit quants u (0..255) would overflow a pair; u - 128 (u ^ 0x80) is a signed byte whose magnitude (<= 128)
//   times a sign-adjusted x (<= 127) keeps a pair within 32512 (llama.cpp's trick), and the group's sum starts at
//   128 * sum(x): sum u x = sum (u - 128) x + 128 sum x, exactly (with Q8_0's folded c = -128, it starts at 0).
#if !defined(DI_AVXVNNI)
inline __m256i widen16(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
#endif

// 32 fifth bits of a 5-bit record (the bytes of one half of a register of nibbles) as 16 in each byte whose bit is
// set (bit_bytes_avx2.h).
inline __m256i fifth_bits(const uint8_t* p) { return bit_bytes(p, 16); }

// Piece p of 8 lanes of a 4- or 5-bit group record as the bytes of the 8-bit layout's pieces 2p (lo) and 2p + 1 (hi):
// the nibbles, + 16 where a 5-bit record's fifth bit is set (fifth: the lanes' bits after the nibbles).
template <int BITS>
inline void piece_quants8(const uint8_t* rec, const uint8_t* fifth, int p, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F), w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p));
  lo = _mm256_and_si256(w, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
  if (BITS == 5) {
    lo = _mm256_or_si256(lo, fifth_bits(fifth + 16 * p));
    hi = _mm256_or_si256(hi, fifth_bits(fifth + 16 * p + 8));
  }
}

// Without VNNI, 4- and 8-bit records with stored or folded offsets (Q4_0, Q4_1, Q8_0, int8, int4 and the K formats
// widened to 8 bits) go through tile_wide: all 16 lanes in one pass over a group, so each broadcast of 4 activations
// feeds both halves' products (a broadcast from memory takes a vector slot on Zen 3, a plain load does not), 3 rows
// a tile (4-bit: 6 int16 sums, 4 registers of nibbles, the mask and 2 broadcasts fill the 16 registers; the float
// sums live in memory between groups). Per lane it runs tile()'s integer sum (in another order: exact) and its
// float steps in the same order: the same bits. SmolLM2's shapes on one Zen 3 thread against tile() with its 4 rows
// (benchmarks/quant_linear_rows.py --threads 1 --variants "src=d5a002b's csrc;DI_WIDE_TILE=4;DI_WIDE_TILE=3;..."):
// - Q4_1 layers: 1.23-1.37x at 64 and 512 rows, 1.10-1.19x at 8, ~1.1x at 1; 4 rows a tile 1.00-1.13x, 2 rows
//   1.02-1.6x;
// - the Q8_0 head: 1.5x / 1.1-1.2x / 1.1-1.2x at 1 / 8 / 64 rows with 3 or 4 rows a tile (2 threads: 1.1-1.2x).
#ifndef DI_WIDE_TILE
#define DI_WIDE_TILE 3
#endif
template <int BITS, int G, int OFF>
constexpr bool wide_tile() {
#if defined(DI_AVXVNNI)
  return false;
#else
  return (OFF == kStored || OFF == kFolded) && ((BITS == 4 && G == 32) || BITS == 8);
#endif
}
template <int BITS, int G, int OFF>
constexpr int tile_rows() { return wide_tile<BITS, G, OFF>() ? DI_WIDE_TILE : kMaxTile; }

#if !defined(DI_AVXVNNI)
// One group's integer sums, lanes 0-7 and 8-15 of MT rows (xq at the group's first value): 4-bit, four pieces'
// products summed in int16 before one widening (tile() below has the bounds), each row's sums kept in order.
template <int MT>
inline void group_sums4(const uint8_t* rec, const int8_t* xq, int64_t K, __m256i (&isum)[MT][2]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i s16[MT][2];
  for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p + 32));
    const __m256i l0 = _mm256_and_si256(w0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low);
    const __m256i l1 = _mm256_and_si256(w1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low);
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = xq + m * K + 8 * p;
      const __m256i xl = _mm256_set1_epi32(load_i32(x)), xh = _mm256_set1_epi32(load_i32(x + 4));
      s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(l0, xl));
      s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(l1, xl));
      s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(h0, xh));
      s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(h1, xh));
      asm("" : "+x"(s16[m][0]), "+x"(s16[m][1]));
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) isum[m][h] = widen16(s16[m][h]);
}

// 8-bit: the signed products of tile() below (u - 128 times a sign-adjusted x), widened piece by piece.
template <int MT, int G>
inline void group_sums8(const uint8_t* rec, const int8_t* xq, int64_t K, __m256i (&isum)[MT][2]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
  for (int p = 0; p < G / 4; ++p) {
    const __m256i ws0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p)), flip);
    const __m256i ws1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p + 32)), flip);
    const __m256i wa0 = _mm256_abs_epi8(ws0), wa1 = _mm256_abs_epi8(ws1);
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_set1_epi32(load_i32(xq + m * K + 4 * p));
      isum[m][0] = _mm256_add_epi32(isum[m][0], widen16(_mm256_maddubs_epi16(wa0, _mm256_sign_epi8(x, ws0))));
      isum[m][1] = _mm256_add_epi32(isum[m][1], widen16(_mm256_maddubs_epi16(wa1, _mm256_sign_epi8(x, ws1))));
    }
  }
}

// 5-bit records with many rows: widen5 writes a block's records once as bytes 0..31 in the 8-bit layout, and
// tile_wide<5> reads those (no unpacking per tile; group_sums_bytes below has the bounds).
#define DI_WIDEN5 1
inline void widen5(const uint8_t* q, int64_t ng, uint8_t* out) {
  for (int64_t g = 0; g < ng; ++g, q += 320, out += 512) {
    for (int line = 0; line < 320; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetch * 320 + line), _MM_HINT_T0);
    for (int p = 0; p < 4; ++p)
      for (int half = 0; half < 2; ++half) {
        __m256i lo, hi;
        piece_quants8<5>(q + 32 * half, q + 256 + 4 * half, p, lo, hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * p + 32 * half), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * p + 64 + 32 * half), hi);
      }
  }
}

// Small byte quants multiplied unsigned, without the sign flip: the products of PW pieces of 8 values (2 maddubs into
// each int16 sum per piece) add up in int16 before each widening. PW 2 for quants <= 31 (a pair of products <= 7874,
// 4 of them <= 31496: widen5's bytes), 1 for quants <= 63 (<= 16002, 2 of them <= 32004: GGUF Q6_K's 8-bit records).
// The weights go two registers at a time so that 3 rows' int16 and int32 sums stay in registers.
template <int MT, int G, int PW>
inline void group_sums_bytes(const uint8_t* rec, const int8_t* xq, int64_t K, __m256i (&isum)[MT][2]) {
  for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
  for (int p0 = 0; p0 < G / 8; p0 += PW) {
    __m256i s16[MT][2];
    for (int m = 0; m < MT; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
    for (int r = 2 * p0; r < 2 * (p0 + PW); ++r) {  // 8-bit pieces: k = 4r..4r+3
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * r));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * r + 32));
      for (int m = 0; m < MT; ++m) {
        const __m256i x = _mm256_set1_epi32(load_i32(xq + m * K + 4 * r));
        s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(w0, x));
        s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(w1, x));
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 2; ++h) isum[m][h] = _mm256_add_epi32(isum[m][h], widen16(s16[m][h]));
  }
}

// BITS 5: the records widen5 wrote (512 bytes a group), not the 5-bit layout; BITS 6: 8-bit records whose quants are
// all below 64.
template <int MT, int BITS, int G, typename ST, int OFF>
void tile_wide(const uint8_t* q, const ST* s, const ST* o, float c, int64_t ng, const int8_t* xq, const float* xd,
               const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
  static_assert(BITS != 5 || G == 32, "widened 5-bit records come in groups of 32");
  constexpr int QB = 16 * G * (BITS == 4 ? 4 : 8) / 8;
  constexpr bool folded = OFF == kFolded;
  const int32_t start = (folded ? (int32_t)c : 0) + (BITS == 8 ? 128 : 0);  // as in tile() below
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* rec = q + g * QB;
    const int64_t k0 = g * G;
    prefetch_ahead<QB>(rec, s + g * 16, OFF == kStored ? o + g * 16 : nullptr);
    __m256i isum[MT][2];
    if constexpr (BITS == 4) group_sums4<MT>(rec, xq + k0, K, isum);
    else if constexpr (BITS == 5) group_sums_bytes<MT, G, 2>(rec, xq + k0, K, isum);
    else if constexpr (BITS == 6) group_sums_bytes<MT, G, 1>(rec, xq + k0, K, isum);
    else group_sums8<MT, G>(rec, xq + k0, K, isum);
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = load8(s + g * 16 + 8 * h);
      const __m256 ov = OFF == kStored ? load8(o + g * 16 + 8 * h) : _mm256_mul_ps(sv, _mm256_set1_ps(c));
      for (int m = 0; m < MT; ++m) {
        __m256i is = isum[m][h];
        if (start != 0) is = _mm256_add_epi32(_mm256_set1_epi32(start * group_xsum<G>(xs, m, K, g)), is);
        const float d = xd[m * (K / 32) + k0 / 32];
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(sv, _mm256_set1_ps(d)), acc[m][h]);
        if (!folded) acc[m][h] = _mm256_fmadd_ps(ov, _mm256_set1_ps(*group_term<G>(xt, m, K, g)), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * ldo + 8 * h, acc[m][h]);
}
#endif

// The other records: lanes 0-7, then 8-15, each half a pass over the group records.
template <int MT, int BITS, int G, typename ST, int OFF>
void tile_halves(const uint8_t* q, const ST* s, const ST* o, float c, int64_t ng, const int8_t* xq, const float* xd,
                 const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
  constexpr int QB = 16 * G * BITS / 8;
  constexpr bool folded = OFF == kFolded || OFF == kTable;
  __m256i table = _mm256_setzero_si256();  // kTable: the 16 values in each 128-bit lane, for vpshufb
  if constexpr (OFF == kTable) table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  for (int half = 0; half < 2; ++half) {  // lanes 0-7, then 8-15
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* rec = q + g * QB + 32 * half;
      const int64_t k0 = g * G;
      if (half == 0) prefetch_ahead<QB>(q + g * QB, s + g * 16, OFF == kStored ? o + g * 16 : nullptr);
#if defined(DI_AVXVNNI)
      constexpr int32_t lift = 0;
#else
      // what the signed products of a table's values (8-bit quants) leave out: 128 * sum(xq)
      constexpr int32_t lift = OFF == kTable ? 128 : 0;
#endif
      // the integer sum starts at (c + lift) * sum(xq) for a folded offset, lift * sum(xq) otherwise
      const int32_t start = (folded ? (int32_t)c : 0) + lift;
      __m256i isum[MT];
      for (int m = 0; m < MT; ++m)
        isum[m] = start != 0 ? _mm256_set1_epi32(start * group_xsum<G>(xs, m, K, g)) : _mm256_setzero_si256();
      if constexpr (BITS == 4 || BITS == 5) {
        const uint8_t* fifth = q + g * QB + 256 + 4 * half;  // + 16p: piece p's low nibbles' bits, + 8 the high's
#if defined(DI_AVXVNNI)
        for (int p = 0; p < G / 8; ++p) {
          __m256i wl, wh;
          piece_quants8<BITS>(rec, fifth, p, wl, wh);
          if constexpr (OFF == kTable) {  // nibble -> its table value
            wl = _mm256_shuffle_epi8(table, wl);
            wh = _mm256_shuffle_epi8(table, wh);
          }
          for (int m = 0; m < MT; ++m) {
            const int8_t* x = xq + m * K + k0 + 8 * p;
            isum[m] = _mm256_dpbusd_avx_epi32(isum[m], wl, _mm256_set1_epi32(load_i32(x)));
            isum[m] = _mm256_dpbusd_avx_epi32(isum[m], wh, _mm256_set1_epi32(load_i32(x + 4)));
          }
        }
#else
        if constexpr (OFF == kTable) {  // table values are 8-bit quants: the signed products of the 8-bit path
          const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
          for (int p = 0; p < G / 8; ++p) {
            __m256i nibs[2];  // the low nibbles (k = 8p..8p+3), then the high (8p+4..8p+7)
            piece_quants8<BITS>(rec, fifth, p, nibs[0], nibs[1]);
            for (int h = 0; h < 2; ++h) {
              const __m256i ws = _mm256_xor_si256(_mm256_shuffle_epi8(table, nibs[h]), flip);
              const __m256i wa = _mm256_abs_epi8(ws);
              for (int m = 0; m < MT; ++m) {
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + m * K + k0 + 8 * p + 4 * h)), ws);
                isum[m] = _mm256_add_epi32(isum[m], widen16(_mm256_maddubs_epi16(wa, x)));
              }
            }
          }
        } else {
          static_assert(BITS == 5, "4-bit records without a table take tile_wide");
          constexpr int PW = 2;  // pieces summed in int16 before widening (see above)
          for (int p0 = 0; p0 < G / 8; p0 += PW) {
            __m256i s16[MT];
            for (int m = 0; m < MT; ++m) s16[m] = _mm256_setzero_si256();
            for (int p = p0; p < std::min(p0 + PW, G / 8); ++p) {
              __m256i wl, wh;
              piece_quants8<BITS>(rec, fifth, p, wl, wh);
              for (int m = 0; m < MT; ++m) {
                const int8_t* x = xq + m * K + k0 + 8 * p;
                s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(load_i32(x))));
                s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(load_i32(x + 4))));
              }
            }
            for (int m = 0; m < MT; ++m) isum[m] = _mm256_add_epi32(isum[m], widen16(s16[m]));
          }
        }
#endif
      } else {
#if defined(DI_AVXVNNI)
        for (int p = 0; p < G / 4; ++p) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p));
          for (int m = 0; m < MT; ++m)
            isum[m] = _mm256_dpbusd_avx_epi32(isum[m], w, _mm256_set1_epi32(load_i32(xq + m * K + k0 + 4 * p)));
        }
#else
        static_assert(BITS != 8, "8-bit records without VNNI take tile_wide");
#endif
      }
      const __m256 sv = load8(s + g * 16 + 8 * half);
      const __m256 ov = OFF == kStored ? load8(o + g * 16 + 8 * half) : _mm256_mul_ps(sv, _mm256_set1_ps(c));
      for (int m = 0; m < MT; ++m) {
        const float d = xd[m * (K / 32) + k0 / 32];
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(sv, _mm256_set1_ps(d)), acc[m]);
        if (!folded) acc[m] = _mm256_fmadd_ps(ov, _mm256_set1_ps(*group_term<G>(xt, m, K, g)), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + 8 * half, acc[m]);
  }
}

template <int MT, int BITS, int G, typename ST, int OFF>
void tile(const uint8_t* q, const ST* s, const ST* o, float c, int64_t ng, const int8_t* xq, const float* xd,
          const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
#if !defined(DI_AVXVNNI)
  if constexpr (wide_tile<BITS, G, OFF>()) {
    tile_wide<MT, BITS, G, ST, OFF>(q, s, o, c, ng, xq, xd, xs, xt, K, out, ldo);
    return;
  } else
#endif
  {
    tile_halves<MT, BITS, G, ST, OFF>(q, s, o, c, ng, xq, xd, xs, xt, K, out, ldo);
  }
}

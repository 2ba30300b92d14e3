// Part of quant_linear.cpp, included there inside its anonymous namespace when the build has neither AVX-512 VNNI
// nor AVX2: tile() in portable C++, the reference the vector bodies match bit for bit. It uses quant_at, scalar_of,
// group_xsum and group_term from quant_linear.cpp and follows the arithmetic described at its top.
template <int MT, int BITS, int G, typename ST, int OFF>
void tile(const uint8_t* q, const ST* s, const ST* o, float c, int64_t ng, const int8_t* xq, const float* xd,
          const int32_t* xs, const float* xt, int64_t K, float* out, int64_t ldo) {
  constexpr int QB = 16 * G * BITS / 8;
  for (int m = 0; m < MT; ++m) {
    for (int j = 0; j < 16; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* rec = q + g * QB;
        int32_t isum = OFF == kFolded || OFF == kTable ? (int32_t)c * group_xsum<G>(xs, m, K, g) : 0;
        for (int i = 0; i < G; ++i) {
          const int u = OFF == kTable ? reinterpret_cast<const uint8_t*>(o)[quant_at<BITS>(rec, j, i)]
                                      : quant_at<BITS>(rec, j, i);
          isum += u * (int32_t)xq[m * K + g * G + i];
        }
        const float sv = scalar_of(s, (int)(g * 16 + j));
        const float d = xd[m * (K / 32) + g * G / 32];
        acc = std::fma((float)isum, sv * d, acc);
        if (OFF != kFolded && OFF != kTable) {
          const float ov = OFF == kStored ? scalar_of(o, (int)(g * 16 + j)) : sv * c;
          acc = std::fma(ov, *group_term<G>(xt, m, K, g), acc);
        }
      }
      out[m * ldo + j] = acc;
    }
  }
}

// Which cache level decode attention's software prefetches fill (included by attention.cpp only): 3 = L1
// (prefetcht0) or 2 = L2 (prefetcht1). A prefetch changes no value, so either gives the same bits.
//
// Measured on SmolLM2's attention shapes with the cache in DRAM (benchmarks/attention_prefetch.py, both levels
// taking turns in one process): on the 2-core Zen 5 EPYC (AMD family 0x1A) L1 was about 1.1x faster than L2 (stop
// 32); on the 2-core Zen 4 EPYC (family 0x19) L2 was 1.5-1.7x faster than L1 at 16-128 rows, 1.06x at one row
// (stop 43; a prefetch into L1 holds one of the L1's few miss buffers until its line comes from DRAM, so the requests
// queue behind each other; the L2 tracks many more). So L1 on AMD family 0x1A and later, L2 elsewhere;
// DEEPINFER_ATTN_PREFETCH=l1|l2 overrides it.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "aten.h"

struct PrefetchChoice {
  int level;  // 3: L1, 2: L2
  std::string why;
};

static inline PrefetchChoice choose_prefetch_level() {
  if (const char* env = std::getenv("DEEPINFER_ATTN_PREFETCH"); env != nullptr && *env != '\0') {
    TORCH_CHECK(std::strcmp(env, "l1") == 0 || std::strcmp(env, "l2") == 0,
                "DEEPINFER_ATTN_PREFETCH must be 'l1' or 'l2' (the cache level decode attention prefetches into), "
                "got '", env, "'");
    return {env[1] == '1' ? 3 : 2, "DEEPINFER_ATTN_PREFETCH"};
  }
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    if (__get_cpuid(1, &a, &b, &c, &d)) {
      unsigned family = (a >> 8) & 0xf;
      if (family == 0xf) family += (a >> 20) & 0xff;
      const bool zen5 = std::strcmp(vendor, "AuthenticAMD") == 0 && family >= 0x1a;
      char why[64];
      std::snprintf(why, sizeof why, "%s family 0x%x", vendor, family);
      return {zen5 ? 3 : 2, why};
    }
  }
#endif
  return {2, "default"};
}

// The machine's choice, made once per process.
static inline const PrefetchChoice& machine_prefetch() {
  static const PrefetchChoice choice = choose_prefetch_level();
  return choice;
}

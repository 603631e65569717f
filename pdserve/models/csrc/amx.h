// What pdserve's kernels share to run on AMX tiles (Sapphire Rapids and later), where -march=native
// compiled them in: the switch, the OS's permission, the tile configuration's layout.
#pragma once

#include <cstdint>

// pdserve's kernels take AMX tiles where they can (true) or stay on AVX-512 (benchmarks compare the
// two; PDSERVE_AMX=0 sets it at load).
extern bool amx_enabled;
// Whether this build has AMX paths and the OS grants the tile state.
bool amx_available();

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDSERVE_AMX 1

#include <immintrin.h>

// _tile_loadconfig's 64 bytes (palette 1): per tile its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#endif

// Both switched on and granted.
inline bool amx_runs() { return amx_enabled && amx_available(); }

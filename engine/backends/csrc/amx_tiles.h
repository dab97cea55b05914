// What the two AMX paths share: the 64-byte tile configuration `ldtilecfg` reads (palette 1), and the one request
// for the tile state. amx.cpp's bf16 tiles (dense weights) and qdot_lanes.h's int8 tiles (tiled quantized ones) each
// fill their own shapes in it.
#pragma once

#include <cstdint>

namespace peregrine {

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // each tile's bytes a row
  uint8_t rows[16] = {};    // each tile's rows
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

bool amx_tiles_permitted();  // amx.cpp: Linux lets the process use the AMX tile state (asked once)

}  // namespace peregrine

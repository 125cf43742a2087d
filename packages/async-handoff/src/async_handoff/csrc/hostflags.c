/* Host flags: see hostflags.h for the slot protocol. C11 atomics, Linux futexes. */
#include "hostflags.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HF_MAGIC 0x46484841u /* "AHHF" */
#define HF_VERSION 1u
#define WORD(seq, state) (((uint64_t)(seq) << 3) | (uint64_t)(state))
#define STATE_OF(w) ((uint32_t)((w) & 7u))
#define SEQ_OF(w) ((w) >> 3)

struct header {
    uint32_t magic, version, nslots, slot_bytes;
    _Atomic uint32_t generation;
    _Atomic uint32_t doorbell; /* futex word: bumped by every submit and generation change */
    _Atomic uint64_t next_seq;
    _Atomic int64_t heartbeat_ns;
    _Atomic uint32_t proxy_pid;
    _Atomic uint32_t proxy_state;
    _Atomic uint32_t doorbell_waiters; /* sleepers on doorbell: wakes skip the syscall at 0 */
};

struct slot {
    _Atomic uint64_t word;
    _Atomic uint32_t generation;
    uint32_t req_len;
    uint64_t reply_seq;
    uint32_t reply_len;
    uint32_t status;
    _Atomic uint32_t reply_event; /* futex word: bumped when a reply is posted */
    _Atomic uint32_t reply_waiters;
    int64_t submit_ns;
    uint64_t req_seal;   /* seal(seq, generation, request): the proxy checks it */
    uint64_t reply_seal; /* seal(seq, status, reply): the engine checks it */
};

_Static_assert(sizeof(struct header) <= HF_STATUS_OFFSET, "header overlaps the status text");
_Static_assert(sizeof(struct slot) == HF_SLOT_CTL_BYTES, "slot control block size");

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

int64_t hf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static size_t ctl_bytes(uint32_t nslots) {
    size_t n = (size_t)nslots * HF_SLOT_CTL_BYTES;
    return (n + 4095) & ~(size_t)4095;
}

size_t hf_region_size(uint32_t nslots, uint32_t slot_bytes) {
    return HF_HEADER_BYTES + ctl_bytes(nslots) + (size_t)nslots * 2 * slot_bytes;
}

static struct header *hdr(const void *base) { return (struct header *)base; }

static struct slot *slot_at(const struct hf_region *r, uint32_t i) {
    return (struct slot *)(r->base + HF_HEADER_BYTES) + i;
}

static uint8_t *req_area(const struct hf_region *r, uint32_t i) {
    return r->base + HF_HEADER_BYTES + ctl_bytes(r->nslots) + (size_t)i * 2 * r->slot_bytes;
}

static uint8_t *reply_area(const struct hf_region *r, uint32_t i) {
    return req_area(r, i) + r->slot_bytes;
}

/* A seal over a round's fields and payload, so bytes scribbled into a slot (by a bug or a
 * stray writer) are refused instead of delivered. A multiply-xorshift mix, 8 bytes a step. */
static uint64_t seal(uint64_t seq, uint64_t tag, const uint8_t *data, uint32_t len) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (seq * 0xBF58476D1CE4E5B9ull) ^ (tag << 32) ^ len;
    uint32_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, data + i, 8);
        h = (h ^ w) * 0x94D049BB133111EBull;
        h ^= h >> 31;
    }
    for (; i < len; i++)
        h = (h ^ data[i]) * 0x100000001B3ull;
    h ^= h >> 29;
    return h | 1; /* never 0: a zeroed slot never carries a valid seal */
}

/* -- primitives ------------------------------------------------------------------------ */
uint32_t hf_load32(uint32_t *p) { return atomic_load_explicit((_Atomic uint32_t *)p, memory_order_acquire); }
void hf_store32(uint32_t *p, uint32_t v) { atomic_store_explicit((_Atomic uint32_t *)p, v, memory_order_release); }
uint64_t hf_load64(uint64_t *p) { return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_acquire); }

int hf_cas64(uint64_t *p, uint64_t expected, uint64_t desired) {
    return atomic_compare_exchange_strong_explicit((_Atomic uint64_t *)p, &expected, desired,
                                                   memory_order_acq_rel, memory_order_acquire);
}

int hf_futex_wait(uint32_t *p, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts = {.tv_sec = timeout_ns / 1000000000, .tv_nsec = timeout_ns % 1000000000};
    /* Not FUTEX_PRIVATE: the word lives in memory shared between processes. */
    long rc = syscall(SYS_futex, p, FUTEX_WAIT, expected, &ts, NULL, 0);
    if (rc == 0)
        return HF_OK;
    return errno == ETIMEDOUT ? HF_ETIMEDOUT : HF_OK; /* EAGAIN/EINTR: value moved, re-check */
}

int hf_futex_wake(uint32_t *p, int n) { return (int)syscall(SYS_futex, p, FUTEX_WAKE, n, NULL, NULL, 0); }

/* Waker and sleeper each write their word, then read the other's (all seq_cst): at least
 * one sees the other, so a wake is never lost, and no futex syscall is made while nobody
 * sleeps (the common case when both sides spin). */
static void bump_and_wake(_Atomic uint32_t *word, _Atomic uint32_t *waiters) {
    atomic_fetch_add(word, 1);
    if (atomic_load(waiters))
        hf_futex_wake((uint32_t *)word, INT_MAX);
}

static int wait_change(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t old, int mode,
                       int64_t spin_ns, int64_t deadline_ns) {
    int64_t now = hf_now_ns(), spin_until = now + spin_ns;
    for (;;) {
        if (atomic_load_explicit(word, memory_order_acquire) != old)
            return HF_OK;
        now = hf_now_ns();
        if (now >= deadline_ns)
            return HF_ETIMEDOUT;
        if (mode == HF_SPIN || now < spin_until) {
            /* Check the word after every pause (one pause is ~40-140 cycles); read the
             * clock only every 128 checks. */
            for (int i = 0; i < 128; i++) {
                if (atomic_load_explicit(word, memory_order_acquire) != old)
                    return HF_OK;
                cpu_relax();
            }
            continue;
        }
        int64_t left = deadline_ns - now;
        atomic_fetch_add(waiters, 1);
        if (atomic_load(word) == old)
            hf_futex_wait((uint32_t *)word, old, left < 100000000 ? left : 100000000);
        atomic_fetch_sub(waiters, 1);
    }
}

/* Wait until *p != old: spin (pause/yield) for spin_ns, then (nap mode) sleep on the futex.
 * spin mode spins until the deadline. (Standalone words: the waker must always wake.) */
int hf_wait_change(uint32_t *p, uint32_t old, int mode, int64_t spin_ns, int64_t deadline_ns) {
    _Atomic uint32_t always = 0;
    return wait_change((_Atomic uint32_t *)p, &always, old, mode, spin_ns, deadline_ns);
}

/* -- region ---------------------------------------------------------------------------- */
int hf_format(void *base, size_t size, uint32_t nslots, uint32_t slot_bytes) {
    if (!nslots || !slot_bytes || size < hf_region_size(nslots, slot_bytes))
        return HF_EBAD;
    memset(base, 0, HF_HEADER_BYTES + ctl_bytes(nslots));
    struct header *h = hdr(base);
    h->nslots = nslots;
    h->slot_bytes = slot_bytes;
    h->version = HF_VERSION;
    atomic_store_explicit(&h->next_seq, 1, memory_order_relaxed);
    atomic_store_explicit(&h->heartbeat_ns, -1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    h->magic = HF_MAGIC; /* last: a reader that sees the magic sees a formatted region */
    return HF_OK;
}

int hf_attach(void *base, size_t size, struct hf_region *out) {
    const struct header *h = hdr(base);
    if (size < HF_HEADER_BYTES || h->magic != HF_MAGIC || h->version != HF_VERSION)
        return HF_EBAD;
    uint32_t nslots = h->nslots, slot_bytes = h->slot_bytes; /* read once */
    if (!nslots || !slot_bytes || nslots > (1u << 20) || size < hf_region_size(nslots, slot_bytes))
        return HF_EBAD;
    out->base = base;
    out->nslots = nslots;
    out->slot_bytes = slot_bytes;
    return HF_OK;
}

void hf_get_info(const struct hf_region *r, struct hf_info *out) {
    struct header *h = hdr(r->base);
    out->nslots = r->nslots;
    out->slot_bytes = r->slot_bytes;
    out->generation = atomic_load(&h->generation);
    out->proxy_pid = atomic_load(&h->proxy_pid);
    out->proxy_state = atomic_load(&h->proxy_state);
    out->next_seq = atomic_load(&h->next_seq);
    int64_t beat = atomic_load_explicit(&h->heartbeat_ns, memory_order_acquire);
    out->heartbeat_age_ns = beat < 0 ? -1 : hf_now_ns() - beat;
}

void hf_set_proxy(const struct hf_region *r, uint32_t pid, uint32_t state) {
    atomic_store(&hdr(r->base)->proxy_pid, pid);
    atomic_store(&hdr(r->base)->proxy_state, state);
}

void hf_heartbeat(const struct hf_region *r) {
    atomic_store_explicit(&hdr(r->base)->heartbeat_ns, hf_now_ns(), memory_order_release);
}

/* -- engine side ----------------------------------------------------------------------- */
int hf_submit(const struct hf_region *r, const uint8_t *req, uint32_t len, uint32_t *slot_out,
              uint64_t *seq_out) {
    struct header *h = hdr(r->base);
    if (len > r->slot_bytes)
        return HF_ETOOBIG;
    for (uint32_t i = 0; i < r->nslots; i++) {
        struct slot *s = slot_at(r, i);
        uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
        if (STATE_OF(w) != HF_FREE)
            continue;
        uint64_t seq = atomic_fetch_add_explicit(&h->next_seq, 1, memory_order_relaxed);
        if (!atomic_compare_exchange_strong_explicit(&s->word, &w, WORD(seq, HF_FILLING),
                                                     memory_order_acq_rel, memory_order_acquire))
            continue;
        uint32_t gen = atomic_load(&h->generation);
        memcpy(req_area(r, i), req, len);
        s->req_len = len;
        s->submit_ns = hf_now_ns();
        s->req_seal = seal(seq, gen, req, len);
        atomic_store_explicit(&s->generation, gen, memory_order_relaxed);
        /* A compare-exchange, not a store: a new generation may have reclaimed the slot
         * while it was filled; then the round is gone and must not come back. */
        uint64_t filling = WORD(seq, HF_FILLING);
        if (!atomic_compare_exchange_strong_explicit(&s->word, &filling, WORD(seq, HF_REQUEST),
                                                     memory_order_acq_rel, memory_order_acquire))
            return HF_ESTALE;
        bump_and_wake(&h->doorbell, &h->doorbell_waiters);
        *slot_out = i;
        *seq_out = seq;
        return HF_OK;
    }
    return HF_EFULL;
}

static int free_slot(struct slot *s, uint64_t w) {
    return atomic_compare_exchange_strong_explicit(&s->word, &w, WORD(SEQ_OF(w), HF_FREE),
                                                   memory_order_acq_rel, memory_order_acquire);
}

int hf_poll(const struct hf_region *r, uint32_t i, uint64_t seq, uint8_t *out, uint32_t cap,
            uint32_t *len, uint32_t *status) {
    if (i >= r->nslots)
        return HF_EBAD;
    struct slot *s = slot_at(r, i);
    uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
    if (SEQ_OF(w) != seq || STATE_OF(w) == HF_FREE)
        return HF_ESTALE;
    if (STATE_OF(w) != HF_REPLY)
        return STATE_OF(w) <= HF_TAKEN ? HF_PENDING : (free_slot(s, w), HF_EBAD);
    uint32_t n = s->reply_len, st = s->status;
    uint64_t want = s->reply_seal;
    if (s->reply_seq != seq || n > r->slot_bytes || n > cap || st > HF_ROUND_BAD) {
        free_slot(s, w);
        return HF_EBAD;
    }
    memcpy(out, reply_area(r, i), n);
    if (want != seal(seq, st, out, n)) { /* checked on the copy: what is handed out */
        free_slot(s, w);
        return HF_EBAD;
    }
    *len = n;
    *status = st;
    return free_slot(s, w) ? HF_OK : HF_ESTALE;
}

int hf_wait_reply(const struct hf_region *r, uint32_t i, uint64_t seq, int mode,
                  int64_t spin_ns, int64_t deadline_ns) {
    if (i >= r->nslots)
        return HF_EBAD;
    struct slot *s = slot_at(r, i);
    for (;;) {
        uint32_t event = atomic_load_explicit(&s->reply_event, memory_order_acquire);
        uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
        if (SEQ_OF(w) != seq || STATE_OF(w) == HF_REPLY || STATE_OF(w) == HF_FREE)
            return HF_OK;
        int rc = wait_change(&s->reply_event, &s->reply_waiters, event, mode, spin_ns, deadline_ns);
        if (rc)
            return rc;
    }
}

int hf_reclaim(const struct hf_region *r, uint32_t i, uint64_t seq) {
    if (i >= r->nslots)
        return HF_EBAD;
    struct slot *s = slot_at(r, i);
    for (;;) {
        uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
        if (SEQ_OF(w) != seq || STATE_OF(w) == HF_FREE)
            return HF_ESTALE;
        if (free_slot(s, w))
            return HF_OK;
    }
}

uint32_t hf_new_generation(const struct hf_region *r, uint32_t *reclaimed) {
    struct header *h = hdr(r->base);
    uint32_t gen = atomic_fetch_add(&h->generation, 1) + 1;
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->nslots; i++) {
        struct slot *s = slot_at(r, i);
        for (;;) {
            uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
            if (STATE_OF(w) == HF_FREE)
                break;
            if (free_slot(s, w)) {
                n++;
                break;
            }
        }
    }
    atomic_store(&h->heartbeat_ns, -1);
    bump_and_wake(&h->doorbell, &h->doorbell_waiters); /* an old proxy still waiting sees the change and leaves */
    *reclaimed = n;
    return gen;
}

/* -- proxy side ------------------------------------------------------------------------ */
int hf_take(const struct hf_region *r, uint32_t generation, int mode, int64_t spin_ns,
            int64_t deadline_ns, uint32_t *slot_out, uint64_t *seq_out, uint8_t *out, uint32_t cap,
            uint32_t *len) {
    struct header *h = hdr(r->base);
    for (;;) {
        uint32_t bell = atomic_load_explicit(&h->doorbell, memory_order_acquire);
        if (atomic_load(&h->generation) != generation)
            return HF_EGEN;
        for (uint32_t i = 0; i < r->nslots; i++) {
            struct slot *s = slot_at(r, i);
            uint64_t w = atomic_load_explicit(&s->word, memory_order_acquire);
            if (STATE_OF(w) != HF_REQUEST ||
                atomic_load_explicit(&s->generation, memory_order_relaxed) != generation)
                continue;
            if (!atomic_compare_exchange_strong_explicit(&s->word, &w, WORD(SEQ_OF(w), HF_TAKEN),
                                                         memory_order_acq_rel, memory_order_acquire))
                continue;
            *slot_out = i;
            *seq_out = SEQ_OF(w);
            uint32_t n = s->req_len;
            uint64_t want = s->req_seal;
            if (n > r->slot_bytes || n > cap)
                return HF_EBAD; /* the caller completes the round with HF_ROUND_BAD */
            memcpy(out, req_area(r, i), n);
            /* Checked on the copy: if the engine abandoned and refilled the slot meanwhile,
             * the torn bytes fail the seal of this round's seq. */
            if (want != seal(SEQ_OF(w), generation, out, n))
                return HF_EBAD;
            *len = n;
            return HF_OK;
        }
        int rc = wait_change(&h->doorbell, &h->doorbell_waiters, bell, mode, spin_ns, deadline_ns);
        if (rc)
            return rc;
    }
}

int hf_complete(const struct hf_region *r, uint32_t i, uint64_t seq, const uint8_t *reply,
                uint32_t len, uint32_t status) {
    if (i >= r->nslots)
        return HF_EBAD;
    if (len > r->slot_bytes)
        return HF_ETOOBIG;
    struct slot *s = slot_at(r, i);
    uint64_t w = WORD(seq, HF_TAKEN);
    if (atomic_load_explicit(&s->word, memory_order_acquire) != w)
        return HF_ESTALE;
    memcpy(reply_area(r, i), reply, len);
    s->reply_len = len;
    s->reply_seq = seq;
    s->status = status;
    s->reply_seal = seal(seq, status, reply, len);
    if (!atomic_compare_exchange_strong_explicit(&s->word, &w, WORD(seq, HF_REPLY),
                                                 memory_order_acq_rel, memory_order_acquire))
        return HF_ESTALE; /* the engine abandoned the round meanwhile */
    bump_and_wake(&s->reply_event, &s->reply_waiters);
    return HF_OK;
}

/* -- benchmark peers ------------------------------------------------------------------- */
/* Answer every round with its request until no round came for idle_ns. Returns rounds served. */
int hf_echo_serve(const struct hf_region *r, uint32_t generation, int mode, int64_t spin_ns,
                  int64_t idle_ns) {
    uint8_t buf[4096];
    uint32_t slot, len;
    uint64_t seq;
    int served = 0;
    for (;;) {
        int rc = hf_take(r, generation, mode, spin_ns, hf_now_ns() + idle_ns, &slot, &seq, buf,
                         sizeof buf, &len);
        if (rc == HF_ETIMEDOUT || rc == HF_EGEN)
            return served;
        if (rc == HF_OK && hf_complete(r, slot, seq, buf, len, HF_ROUND_OK) == HF_OK)
            served++;
    }
}

/* `count` rounds of submit -> wait -> poll; rtt_ns[i] = each round trip. 0 or an error. */
int hf_ping(const struct hf_region *r, const uint8_t *req, uint32_t len, int mode,
            int64_t spin_ns, uint32_t count, int64_t *rtt_ns) {
    uint8_t out[4096];
    uint32_t slot, n, status;
    uint64_t seq;
    for (uint32_t i = 0; i < count; i++) {
        int64_t t = hf_now_ns();
        int rc = hf_submit(r, req, len, &slot, &seq);
        if (rc)
            return rc;
        rc = hf_wait_reply(r, slot, seq, mode, spin_ns, t + 1000000000LL);
        if (rc)
            return rc;
        rc = hf_poll(r, slot, seq, out, sizeof out, &n, &status);
        if (rc)
            return rc;
        rtt_ns[i] = hf_now_ns() - t;
    }
    return HF_OK;
}

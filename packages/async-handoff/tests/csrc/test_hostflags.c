/* Two threads, engine and proxy, hand N rounds through the slot protocol in both wait
 * modes, with the engine abandoning some rounds. Every reply must be the one for its own
 * round: none lost, duplicated or crossed. Built natively and for aarch64 (qemu-user). */
#include "hostflags.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct hf_region region;
static const struct hf_region *r = &region;
static volatile int done;
static int mode;

static void *proxy(void *arg) {
    uint32_t gen = *(uint32_t *)arg, slot, len;
    uint64_t seq;
    uint8_t buf[64];
    while (!done) {
        int rc = hf_take(r, gen, mode, 20000, hf_now_ns() + 50000000, &slot, &seq, buf,
                         sizeof buf, &len);
        if (rc == HF_OK) {
            buf[0] ^= 0xFF; /* the "answer": the request with its first byte flipped */
            hf_complete(r, slot, seq, buf, len, HF_ROUND_OK);
        }
    }
    return NULL;
}

static int run(int n, int wait_mode) {
    mode = wait_mode;
    done = 0;
    size_t size = hf_region_size(4, 64);
    void *base = aligned_alloc(4096, (size + 4095) & ~(size_t)4095);
    hf_format(base, size, 4, 64);
    hf_attach(base, size, &region);
    uint32_t reclaimed, gen = hf_new_generation(r, &reclaimed);
    pthread_t t;
    pthread_create(&t, NULL, proxy, &gen);
    int ok = 0, abandoned = 0, wrong = 0;
    for (int i = 0; i < n; i++) {
        uint8_t req[16], out[64];
        uint32_t slot, len, status;
        uint64_t seq;
        snprintf((char *)req, sizeof req, "round%09d", i);
        while (hf_submit(r, req, sizeof req, &slot, &seq) != HF_OK)
            ;
        if (i % 97 == 0) { /* give up on this one at once */
            hf_reclaim(r, slot, seq);
            abandoned++;
            continue;
        }
        /* a reply ends the wait; the bound only catches a round really lost, so it is far
         * beyond what a loaded machine under qemu-user may delay a reply */
        hf_wait_reply(r, slot, seq, mode, 20000, hf_now_ns() + 60000000000LL);
        int rc = hf_poll(r, slot, seq, out, sizeof out, &len, &status);
        if (rc == HF_OK) {
            req[0] ^= 0xFF;
            if (len != sizeof req || memcmp(out, req, len))
                wrong++;
            else
                ok++;
        }
    }
    done = 1;
    pthread_join(t, NULL);
    free(base);
    printf("mode %d: %d ok, %d abandoned, %d wrong, %d lost\n", wait_mode, ok, abandoned, wrong,
           n - ok - abandoned - wrong);
    return wrong == 0 && ok + abandoned == n;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100000;
    int good = run(n, HF_SPIN) & run(n, HF_NAP);
    printf("%s\n", good ? "ok" : "FAIL");
    return good ? 0 : 1;
}

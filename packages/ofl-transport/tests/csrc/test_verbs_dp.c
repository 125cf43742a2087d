/* Work-request and completion handling of the verbs data path, against fake QP/CQ objects.
 * No device and no libibverbs needed: the helper reaches the device only through the
 * static inline verbs, which call the ops table we fill here. Built natively and for
 * aarch64 (run under qemu-user) by tests/test_verbs_fake.py. */
#include "ofl_verbs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
        }                                                                  \
    } while (0)

/* A fake RC send queue: executes RDMA READs against `remote` at post time (copying into
 * local memory) and queues a completion for every signalled WR. */
#define MAXQ 4096
static uint8_t *remote;
static struct ibv_wc cq_entries[MAXQ];
static int cq_head, cq_tail;
static int posted_wrs, posted_calls, signalled, outstanding, max_outstanding;
static int fail_wr_id = -1;         /* complete this wr_id with an error */
static int drop_completions;        /* never complete anything (stalled peer) */
static int recv_posted;

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    (void)qp;
    posted_calls++;
    for (; wr; wr = wr->next) {
        posted_wrs++;
        outstanding++;
        if (outstanding > max_outstanding)
            max_outstanding = outstanding;
        if (wr->opcode == IBV_WR_RDMA_READ) {
            CHECK(wr->num_sge == 1, "one SGE per row");
            memcpy((void *)(uintptr_t)wr->sg_list[0].addr,
                   remote + (wr->wr.rdma.remote_addr - 0x10000), wr->sg_list[0].length);
        }
        if ((wr->send_flags & IBV_SEND_SIGNALED) && !drop_completions) {
            struct ibv_wc *wc = &cq_entries[cq_tail++ % MAXQ];
            memset(wc, 0, sizeof(*wc));
            wc->wr_id = wr->wr_id;
            wc->status = ((int)wr->wr_id == fail_wr_id) ? IBV_WC_REM_ACCESS_ERR : IBV_WC_SUCCESS;
            wc->opcode = wr->opcode == IBV_WR_SEND ? IBV_WC_SEND : IBV_WC_RDMA_READ;
            signalled++;
        }
    }
    (void)bad;
    return 0;
}

static int fake_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
    (void)cq;
    int k = 0;
    while (k < n && cq_head < cq_tail) {
        wc[k] = cq_entries[cq_head++ % MAXQ];
        /* A signalled completion retires every WR posted before it (RC ordering). */
        outstanding = 0;
        k++;
    }
    return k;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
    (void)qp, (void)bad;
    for (; wr; wr = wr->next)
        recv_posted++;
    return 0;
}

static int fake_notify(struct ibv_cq *cq, int solicited) { (void)cq, (void)solicited; return 0; }

/* Referenced by the helper's blocking path, never reached with recv_channel == NULL. */
int ibv_get_cq_event(struct ibv_comp_channel *c, struct ibv_cq **cq, void **ctx) {
    (void)c, (void)cq, (void)ctx;
    return -1;
}
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n) { (void)cq, (void)n; }

static struct ibv_context ctx;
static struct ibv_qp qp;
static struct ibv_cq cq;

static struct ofl_qp make_qp(uint32_t depth) {
    memset(&ctx, 0, sizeof(ctx));
    ctx.ops.post_send = fake_post_send;
    ctx.ops.post_recv = fake_post_recv;
    ctx.ops.poll_cq = fake_poll_cq;
    ctx.ops.req_notify_cq = fake_notify;
    memset(&qp, 0, sizeof(qp));
    qp.context = &ctx;
    memset(&cq, 0, sizeof(cq));
    cq.context = &ctx;
    struct ofl_qp q = {.qp = &qp, .send_cq = &cq, .recv_cq = &cq, .recv_channel = NULL,
                       .sq_depth = depth, .max_reads = depth / 2 > 256 ? 256 : depth / 2};
    return q;
}

static void reset(void) {
    cq_head = cq_tail = posted_wrs = posted_calls = signalled = outstanding = max_outstanding = 0;
    fail_wr_id = -1;
    drop_completions = 0;
    recv_posted = 0;
}

static void test_gather_fixed_rows(void) {
    reset();
    struct ofl_qp q = make_qp(512);
    const size_t rows = 24 * 700, row = 264; /* an Engram-shaped batch: 700 tokens */
    uint64_t *offsets = malloc(rows * sizeof(*offsets));
    uint8_t *local = calloc(rows, row);
    for (size_t i = 0; i < rows; i++)
        offsets[i] = ((i * 7919) % 50000) * row + (i % 3);
    struct ofl_status st;
    int rc = ofl_read_gather(&q, 0x10000, 42, offsets, NULL, row, rows, (uint64_t)(uintptr_t)local,
                             7, ofl_now_ns() + 1000000000LL, &st);
    CHECK(rc == OFL_OK, "rc=%d", rc);
    CHECK(posted_wrs == (int)rows, "posted %d WRs for %zu rows", posted_wrs, rows);
    /* Selective signalling: one signalled WR per batch of 256, one post call per batch. */
    CHECK(signalled == (int)((rows + 255) / 256), "signalled %d", signalled);
    CHECK(posted_calls == signalled, "post calls %d", posted_calls);
    CHECK(st.posted == rows && st.signalled == (uint64_t)signalled, "status counters");
    CHECK(max_outstanding <= 512, "never more WRs outstanding (%d) than the SQ holds",
          max_outstanding);
    for (size_t i = 0; i < rows; i++)
        if (memcmp(local + i * row, remote + offsets[i], row)) {
            CHECK(0, "row %zu differs", i);
            break;
        }
    free(offsets);
    free(local);
}

static void test_gather_variable_lengths(void) {
    reset();
    struct ofl_qp q = make_qp(8); /* tiny queue: batches of 4, two in flight */
    uint64_t offsets[11];
    uint32_t lengths[11];
    size_t total = 0;
    for (int i = 0; i < 11; i++) {
        offsets[i] = 1000 * i + 5;
        lengths[i] = 1 + 37 * i;
        total += lengths[i];
    }
    uint8_t *local = calloc(1, total);
    struct ofl_status st;
    int rc = ofl_read_gather(&q, 0x10000, 1, offsets, lengths, 0, 11, (uint64_t)(uintptr_t)local, 1,
                             ofl_now_ns() + 1000000000LL, &st);
    CHECK(rc == OFL_OK, "rc=%d", rc);
    CHECK(signalled == 3, "11 reads in batches of 4 -> 3 signalled, got %d", signalled);
    CHECK(max_outstanding <= 8, "outstanding %d > depth 8", max_outstanding);
    size_t pos = 0;
    for (int i = 0; i < 11; i++) {
        CHECK(!memcmp(local + pos, remote + offsets[i], lengths[i]), "range %d differs", i);
        pos += lengths[i];
    }
    free(local);
}

static void test_completion_error_reported(void) {
    reset();
    struct ofl_qp q = make_qp(16);
    uint64_t offsets[20] = {0};
    uint8_t local[20 * 8];
    fail_wr_id = 15; /* last WR of the second batch (batches of 8) */
    struct ofl_status st;
    int rc = ofl_read_gather(&q, 0x10000, 1, offsets, NULL, 8, 20, (uint64_t)(uintptr_t)local, 1,
                             ofl_now_ns() + 1000000000LL, &st);
    CHECK(rc == OFL_EWC, "rc=%d", rc);
    CHECK(st.wc_status == IBV_WC_REM_ACCESS_ERR && st.wr_id == 15, "status %d wr %llu",
          st.wc_status, (unsigned long long)st.wr_id);
}

static void test_deadline_fires(void) {
    reset();
    struct ofl_qp q = make_qp(16);
    uint64_t offsets[4] = {0};
    uint8_t local[32];
    drop_completions = 1;
    struct ofl_status st;
    int64_t t0 = ofl_now_ns();
    int rc = ofl_read_gather(&q, 0x10000, 1, offsets, NULL, 8, 4, (uint64_t)(uintptr_t)local, 1,
                             t0 + 20000000LL, &st);
    int64_t waited = ofl_now_ns() - t0;
    CHECK(rc == OFL_ETIMEDOUT, "rc=%d", rc);
    CHECK(waited >= 20000000LL && waited < 2000000000LL, "waited %lld ns", (long long)waited);
}

static void test_bad_arguments(void) {
    reset();
    struct ofl_qp q = make_qp(1); /* no room for two batches */
    uint64_t off = 0;
    uint8_t local[8];
    struct ofl_status st;
    CHECK(ofl_read_gather(&q, 0x10000, 1, &off, NULL, 8, 1, (uint64_t)(uintptr_t)local, 1,
                          ofl_now_ns() + 1000000, &st) == OFL_EINVAL, "depth 1 refused");
    q = make_qp(16);
    CHECK(ofl_read_gather(&q, 0x10000, 1, &off, NULL, 0, 1, (uint64_t)(uintptr_t)local, 1,
                          ofl_now_ns() + 1000000, &st) == OFL_EINVAL, "row length 0 refused");
    CHECK(posted_wrs == 0, "nothing posted for bad arguments");
}

static void test_send_and_recv(void) {
    reset();
    struct ofl_qp q = make_qp(16);
    uint8_t msg[64] = "hello";
    struct ofl_status st;
    CHECK(ofl_post_recv(&q, (uint64_t)(uintptr_t)msg, 64, 3, 9) == OFL_OK, "post recv");
    CHECK(recv_posted == 1, "one receive posted");
    CHECK(ofl_send(&q, (uint64_t)(uintptr_t)msg, 5, 3, 77, ofl_now_ns() + 1000000000LL, &st) ==
              OFL_OK, "send completes");
    /* A receive completion queued on the CQ is returned with its length and slot. */
    struct ibv_wc *wc = &cq_entries[cq_tail++ % MAXQ];
    memset(wc, 0, sizeof(*wc));
    wc->wr_id = 9;
    wc->byte_len = 5;
    wc->opcode = IBV_WC_RECV;
    struct ofl_completion c;
    CHECK(ofl_wait_recv(&q, ofl_now_ns() + 1000000000LL, 0, &c, &st) == OFL_OK, "recv");
    CHECK(c.wr_id == 9 && c.byte_len == 5, "slot %llu len %u", (unsigned long long)c.wr_id,
          c.byte_len);
    CHECK(ofl_wait_recv(&q, ofl_now_ns() + 5000000LL, 0, &c, &st) == OFL_ETIMEDOUT,
          "no message -> deadline");
}

int main(void) {
    remote = malloc(64 << 20);
    for (size_t i = 0; i < (64u << 20); i++)
        remote[i] = (uint8_t)(i * 2654435761u >> 11);
    test_gather_fixed_rows();
    test_gather_variable_lengths();
    test_completion_error_reported();
    test_deadline_fires();
    test_bad_arguments();
    test_send_and_recv();
    free(remote);
    printf("%s: %d failures\n", failures ? "FAIL" : "ok", failures);
    return failures ? 1 : 0;
}

/* The verbs data path: batched RDMA READ gathers with selective signalling, and messages. */
#include "ofl_verbs.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <time.h>

int64_t ofl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Poll the send CQ until a completion with wr_id >= want arrives. wr_ids rise within a
 * call and an RC send queue completes in order, so one signalled completion retires every
 * earlier work request, including batches whose completion was reaped by an earlier poll.
 * *done holds 1 + the highest wr_id seen. */
static int wait_send(struct ofl_qp *q, uint64_t want, uint64_t *done, int64_t deadline_ns,
                     struct ofl_status *st) {
    struct ibv_wc wc[16];
    while (*done <= want) {
        int n = ibv_poll_cq(q->send_cq, 16, wc);
        if (n < 0)
            return OFL_EPOLL;
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                st->wc_status = wc[i].status;
                st->wr_id = wc[i].wr_id;
                return OFL_EWC;
            }
            if (wc[i].wr_id + 1 > *done)
                *done = wc[i].wr_id + 1;
        }
        if (n == 0 && ofl_now_ns() > deadline_ns)
            return OFL_ETIMEDOUT;
    }
    return OFL_OK;
}

int ofl_read_gather(struct ofl_qp *q, uint64_t remote_base, uint32_t rkey,
                    const uint64_t *offsets, const uint32_t *lengths, uint32_t row_len,
                    size_t count, uint64_t local_addr, uint32_t lkey, int64_t deadline_ns,
                    struct ofl_status *st) {
    enum { MAX_BATCH = 256 };
    struct ibv_send_wr wr[MAX_BATCH];
    struct ibv_sge sge[MAX_BATCH];
    uint32_t batch = q->max_reads;
    if (batch == 0 || batch > MAX_BATCH || 2 * batch > q->sq_depth || (!lengths && !row_len))
        return OFL_EINVAL;
    memset(st, 0, sizeof(*st));

    /* Two batches in flight: post batch k+1 before waiting for batch k, so the link never
     * idles while Python-free C code refills it. wr_id = index of the batch's last row. */
    uint64_t inflight[2], done = 0;
    int n_inflight = 0;
    size_t i = 0;
    uint64_t dest = local_addr;
    while (i < count || n_inflight) {
        if (i < count && n_inflight < 2) {
            size_t n = count - i < batch ? count - i : batch;
            for (size_t k = 0; k < n; k++) {
                uint32_t len = lengths ? lengths[i + k] : row_len;
                sge[k].addr = dest;
                sge[k].length = len;
                sge[k].lkey = lkey;
                memset(&wr[k], 0, sizeof(wr[k]));
                wr[k].wr_id = i + k;
                wr[k].sg_list = &sge[k];
                wr[k].num_sge = 1;
                wr[k].opcode = IBV_WR_RDMA_READ;
                wr[k].send_flags = (k == n - 1) ? IBV_SEND_SIGNALED : 0;
                wr[k].wr.rdma.remote_addr = remote_base + offsets[i + k];
                wr[k].wr.rdma.rkey = rkey;
                wr[k].next = (k == n - 1) ? NULL : &wr[k + 1];
                dest += len;
            }
            struct ibv_send_wr *bad = NULL;
            int rc = ibv_post_send(q->qp, wr, &bad);
            if (rc) {
                st->sys_errno = rc;
                st->wr_id = bad ? bad->wr_id : i;
                return OFL_EPOST;
            }
            st->posted += n;
            st->signalled += 1;
            inflight[n_inflight++] = i + n - 1;
            i += n;
            continue;
        }
        int rc = wait_send(q, inflight[0], &done, deadline_ns, st);
        if (rc)
            return rc;
        inflight[0] = inflight[1];
        n_inflight--;
    }
    return OFL_OK;
}

int ofl_post_recv(struct ofl_qp *q, uint64_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id) {
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_recv_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .next = NULL};
    struct ibv_recv_wr *bad = NULL;
    return ibv_post_recv(q->qp, &wr, &bad) ? OFL_EPOST : OFL_OK;
}

int ofl_send(struct ofl_qp *q, uint64_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id,
             int64_t deadline_ns, struct ofl_status *st) {
    struct ibv_sge sge = {.addr = addr, .length = len, .lkey = lkey};
    struct ibv_send_wr wr;
    memset(&wr, 0, sizeof(wr));
    memset(st, 0, sizeof(*st));
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(q->qp, &wr, &bad);
    if (rc) {
        st->sys_errno = rc;
        return OFL_EPOST;
    }
    st->posted = st->signalled = 1;
    uint64_t done = 0;
    return wait_send(q, wr_id, &done, deadline_ns, st);
}

static int take_recv(const struct ibv_wc *wc, struct ofl_completion *out, struct ofl_status *st) {
    out->wr_id = wc->wr_id;
    out->byte_len = wc->byte_len;
    out->opcode = wc->opcode;
    out->status = wc->status;
    if (wc->status != IBV_WC_SUCCESS) {
        st->wc_status = wc->status;
        st->wr_id = wc->wr_id;
        return OFL_EWC;
    }
    return OFL_OK;
}

/* Wait for one receive completion: spin for spin_ns (latency), then sleep on the
 * completion channel (no CPU burnt by idle server connections). */
int ofl_wait_recv(struct ofl_qp *q, int64_t deadline_ns, int64_t spin_ns,
                  struct ofl_completion *out, struct ofl_status *st) {
    struct ibv_wc wc;
    int64_t spin_until = ofl_now_ns() + spin_ns;
    memset(st, 0, sizeof(*st));
    for (;;) {
        int n = ibv_poll_cq(q->recv_cq, 1, &wc);
        if (n < 0)
            return OFL_EPOLL;
        if (n == 1)
            return take_recv(&wc, out, st);
        int64_t now = ofl_now_ns();
        if (now > deadline_ns)
            return OFL_ETIMEDOUT;
        if (now < spin_until || !q->recv_channel)
            continue;
        /* Arm, re-check (a completion may have raced the arming), then sleep. */
        if (ibv_req_notify_cq(q->recv_cq, 0))
            return OFL_EPOLL;
        n = ibv_poll_cq(q->recv_cq, 1, &wc);
        if (n < 0)
            return OFL_EPOLL;
        if (n == 1)
            return take_recv(&wc, out, st);
        int64_t wait_ms = (deadline_ns - now) / 1000000 + 1;
        struct pollfd pfd = {.fd = q->recv_channel->fd, .events = POLLIN};
        int pr = poll(&pfd, 1, wait_ms > 100 ? 100 : (int)wait_ms);
        if (pr < 0 && errno != EINTR)
            return OFL_EPOLL;
        if (pr > 0) {
            struct ibv_cq *ev_cq;
            void *ev_ctx;
            if (ibv_get_cq_event(q->recv_channel, &ev_cq, &ev_ctx) == 0)
                ibv_ack_cq_events(ev_cq, 1);
        }
    }
}

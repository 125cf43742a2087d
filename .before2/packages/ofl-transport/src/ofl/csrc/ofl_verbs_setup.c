/* Queue-pair set-up: CQs, completion channel, an RC QP and its INIT -> RTR -> RTS walk.
 *
 * pyverbs finds the device and queries its ports and GIDs. Its objects do not hand out
 * usable C pointers (Context.context and PD.pd in rdma-core < 61 return the pointer cast to
 * a Python object, and touching it crashes), so everything the data path posts on - the
 * context, protection domain, memory registrations and queue pairs - is made here. */
#include "ofl_verbs.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int fail(struct ofl_status *st) {
    st->sys_errno = errno ? errno : EIO;
    return OFL_ESYS;
}

int ofl_device_open(const char *name, struct ofl_device **out, struct ofl_status *st) {
    memset(st, 0, sizeof(*st));
    int n = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list)
        return fail(st);
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n && !dev; i++)
        if (!strcmp(ibv_get_device_name(list[i]), name))
            dev = list[i];
    struct ofl_device *d = NULL;
    int rc = OFL_OK;
    if (!dev) {
        errno = ENODEV;
        rc = fail(st);
    } else if (!(d = calloc(1, sizeof(*d))) || !(d->ctx = ibv_open_device(dev)) ||
               !(d->pd = ibv_alloc_pd(d->ctx))) {
        rc = fail(st);
        ofl_device_close(d);
        d = NULL;
    }
    ibv_free_device_list(list);
    *out = d;
    return rc;
}

void ofl_device_close(struct ofl_device *d) {
    if (!d)
        return;
    if (d->pd)
        ibv_dealloc_pd(d->pd);
    if (d->ctx)
        ibv_close_device(d->ctx);
    free(d);
}

struct ibv_mr *ofl_reg_mr(struct ofl_device *d, uint64_t addr, size_t len, int access,
                          struct ofl_status *st) {
    memset(st, 0, sizeof(*st));
    errno = 0;
    struct ibv_mr *mr = ibv_reg_mr(d->pd, (void *)(uintptr_t)addr, len, access);
    if (!mr)
        fail(st);
    return mr;
}

uint32_t ofl_mr_lkey(struct ibv_mr *mr) { return mr->lkey; }
uint32_t ofl_mr_rkey(struct ibv_mr *mr) { return mr->rkey; }
int ofl_dereg_mr(struct ibv_mr *mr) { return ibv_dereg_mr(mr); }

int ofl_qp_create(struct ofl_device *dev, uint32_t sq_depth, uint32_t rq_depth,
                  struct ofl_qp **out, struct ofl_status *st) {
    memset(st, 0, sizeof(*st));
    if (!dev || sq_depth < 2 || rq_depth < 1)
        return OFL_EINVAL;
    struct ibv_context *ctx = dev->ctx;
    struct ibv_pd *pd = dev->pd;
    struct ofl_qp *q = calloc(1, sizeof(*q));
    if (!q)
        return fail(st);
    errno = 0;
    q->recv_channel = ibv_create_comp_channel(ctx);
    if (!q->recv_channel)
        goto err;
    q->send_cq = ibv_create_cq(ctx, (int)sq_depth, NULL, NULL, 0);
    q->recv_cq = ibv_create_cq(ctx, (int)rq_depth, NULL, q->recv_channel, 0);
    if (!q->send_cq || !q->recv_cq)
        goto err;
    struct ibv_qp_init_attr attr = {
        .send_cq = q->send_cq,
        .recv_cq = q->recv_cq,
        .cap = {.max_send_wr = sq_depth, .max_recv_wr = rq_depth, .max_send_sge = 1,
                .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0, /* selective signalling: only the last read of a batch completes */
    };
    q->qp = ibv_create_qp(pd, &attr);
    if (!q->qp)
        goto err;
    q->sq_depth = attr.cap.max_send_wr < sq_depth ? attr.cap.max_send_wr : sq_depth;
    q->max_reads = q->sq_depth / 2 > 256 ? 256 : q->sq_depth / 2;
    *out = q;
    return OFL_OK;
err:;
    int rc = fail(st);
    ofl_qp_destroy(q);
    return rc;
}

int ofl_qp_connect(struct ofl_qp *q, uint8_t port, uint8_t gid_index, uint32_t local_psn,
                   uint32_t remote_qpn, uint32_t remote_psn, const uint8_t *remote_gid,
                   int mtu, uint8_t max_rd_atomic, struct ofl_status *st) {
    memset(st, 0, sizeof(*st));
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = port;
    a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
    errno = 0;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                     IBV_QP_ACCESS_FLAGS))
        return fail(st);

    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)mtu;
    a.dest_qp_num = remote_qpn;
    a.rq_psn = remote_psn;
    a.max_dest_rd_atomic = max_rd_atomic;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, remote_gid, 16);
    a.ah_attr.grh.sgid_index = gid_index;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.port_num = port;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                     IBV_QP_MIN_RNR_TIMER))
        return fail(st);

    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = local_psn;
    a.timeout = 14;   /* ~67 ms local ACK timeout */
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = max_rd_atomic;
    if (ibv_modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC))
        return fail(st);
    return OFL_OK;
}

uint32_t ofl_qp_num(struct ofl_qp *q) { return q->qp->qp_num; }

void ofl_qp_destroy(struct ofl_qp *q) {
    if (!q)
        return;
    if (q->qp)
        ibv_destroy_qp(q->qp);
    if (q->send_cq)
        ibv_destroy_cq(q->send_cq);
    if (q->recv_cq)
        ibv_destroy_cq(q->recv_cq);
    if (q->recv_channel)
        ibv_destroy_comp_channel(q->recv_channel);
    free(q);
}

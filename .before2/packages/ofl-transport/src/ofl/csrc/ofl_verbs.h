/* ofl verbs helper: queue-pair set-up and the data path that Python must not loop over.
 *
 * Data path (ofl_verbs_dp.c) touches the device only through the static inline verbs
 * (ibv_post_send/recv, ibv_poll_cq, ibv_req_notify_cq), so its tests can run against fake
 * QP/CQ objects. Set-up (ofl_verbs_setup.c) calls libibverbs. */
#ifndef OFL_VERBS_H
#define OFL_VERBS_H

#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>

/* Everything from here to "cdef-end" is also read by _verbs_build.py as the cffi cdef. */
/* cdef-begin */
/* Error codes returned by the helper (negative; 0 = success). */
enum ofl_rc {
    OFL_OK = 0,
    OFL_ETIMEDOUT = -1, /* deadline passed; outstanding work requests may remain */
    OFL_EPOST = -2,     /* ibv_post_* refused a work request */
    OFL_EPOLL = -3,     /* ibv_poll_cq failed */
    OFL_EWC = -4,       /* a completion carried an error status (see ofl_status) */
    OFL_EINVAL = -5,    /* bad arguments */
    OFL_ESYS = -6,      /* a set-up verb failed (errno in ofl_status.sys_errno) */
};

struct ofl_qp {
    struct ibv_qp *qp;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_comp_channel *recv_channel; /* NULL: receives are busy-polled */
    uint32_t sq_depth;                     /* send work requests the QP holds */
    uint32_t max_reads;                    /* reads per signalled batch (<= sq_depth / 2) */
};

struct ofl_status {
    int wc_status;      /* enum ibv_wc_status of the failed completion */
    uint64_t wr_id;     /* its work-request id */
    int sys_errno;
    uint64_t posted;    /* work requests posted by the call */
    uint64_t signalled; /* of which signalled */
};

struct ofl_completion {
    uint64_t wr_id;
    uint32_t byte_len;
    int opcode;
    int status;
};

/* Data path */
int ofl_read_gather(struct ofl_qp *q, uint64_t remote_base, uint32_t rkey,
                    const uint64_t *offsets, const uint32_t *lengths, uint32_t row_len,
                    size_t count, uint64_t local_addr, uint32_t lkey, int64_t deadline_ns,
                    struct ofl_status *st);
int ofl_post_recv(struct ofl_qp *q, uint64_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id);
int ofl_send(struct ofl_qp *q, uint64_t addr, uint32_t len, uint32_t lkey, uint64_t wr_id,
             int64_t deadline_ns, struct ofl_status *st);
int ofl_wait_recv(struct ofl_qp *q, int64_t deadline_ns, int64_t spin_ns,
                  struct ofl_completion *out, struct ofl_status *st);
int64_t ofl_now_ns(void);

/* Set-up */
struct ofl_device {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
};
int ofl_device_open(const char *name, struct ofl_device **out, struct ofl_status *st);
void ofl_device_close(struct ofl_device *d);
struct ibv_mr *ofl_reg_mr(struct ofl_device *d, uint64_t addr, size_t len, int access,
                          struct ofl_status *st);
uint32_t ofl_mr_lkey(struct ibv_mr *mr);
uint32_t ofl_mr_rkey(struct ibv_mr *mr);
int ofl_dereg_mr(struct ibv_mr *mr);
int ofl_qp_create(struct ofl_device *dev, uint32_t sq_depth, uint32_t rq_depth, struct ofl_qp **out, struct ofl_status *st);
int ofl_qp_connect(struct ofl_qp *q, uint8_t port, uint8_t gid_index, uint32_t local_psn,
                   uint32_t remote_qpn, uint32_t remote_psn, const uint8_t *remote_gid,
                   int mtu, uint8_t max_rd_atomic, struct ofl_status *st);
uint32_t ofl_qp_num(struct ofl_qp *q);
void ofl_qp_destroy(struct ofl_qp *q);

/* cdef-end */

#endif

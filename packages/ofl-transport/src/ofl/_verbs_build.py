"""cffi (API mode) builder of the verbs helper `ofl._verbs_cffi`; run by hatch_build.py.

API mode because ibv_post_send, ibv_post_recv and ibv_poll_cq are static inline functions
in verbs.h: only compiled code reaches them.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).parent / "csrc"

CDEF = """
struct ibv_mr;
struct ofl_device;
struct ofl_qp;
struct ofl_status { int wc_status; uint64_t wr_id; int sys_errno; uint64_t posted;
                    uint64_t signalled; };
struct ofl_completion { uint64_t wr_id; uint32_t byte_len; int opcode; int status; };
#define OFL_OK ...
#define OFL_ETIMEDOUT ...
#define OFL_EPOST ...
#define OFL_EPOLL ...
#define OFL_EWC ...
#define OFL_EINVAL ...
#define OFL_ESYS ...
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
int ofl_device_open(const char *name, struct ofl_device **out, struct ofl_status *st);
void ofl_device_close(struct ofl_device *d);
struct ibv_mr *ofl_reg_mr(struct ofl_device *d, uint64_t addr, size_t len, int access,
                          struct ofl_status *st);
uint32_t ofl_mr_lkey(struct ibv_mr *mr);
uint32_t ofl_mr_rkey(struct ibv_mr *mr);
int ofl_dereg_mr(struct ibv_mr *mr);
int ofl_qp_create(struct ofl_device *dev, uint32_t sq_depth, uint32_t rq_depth,
                  struct ofl_qp **out, struct ofl_status *st);
int ofl_qp_connect(struct ofl_qp *q, uint8_t port, uint8_t gid_index, uint32_t local_psn,
                   uint32_t remote_qpn, uint32_t remote_psn, const uint8_t *remote_gid,
                   int mtu, uint8_t max_rd_atomic, struct ofl_status *st);
uint32_t ofl_qp_num(struct ofl_qp *q);
void ofl_qp_destroy(struct ofl_qp *q);
const char *ibv_wc_status_str(int status);
"""


def builder() -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "ofl._verbs_cffi",
        '#include "ofl_verbs.h"\n',
        sources=[str(CSRC / "ofl_verbs_dp.c"), str(CSRC / "ofl_verbs_setup.c")],
        include_dirs=[str(CSRC)],
        libraries=["ibverbs"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    )
    return ffi

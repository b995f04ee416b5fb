/* stfs ioctl ABI. Mirrors src/fs/ioctl.rs; see docs/SEMANTICS.md.
 *
 * FUSE passes only fixed-size ioctls: every struct has a fixed size, and its
 * first field is that size, which the daemon checks (EINVAL on a mismatch).
 */
#ifndef STFS_H
#define STFS_H

#include <stdint.h>
#include <linux/ioctl.h>

#define STFS_IOC_TYPE 's'
#define STFS_MESSAGE_LEN 4080

/* Commit flags. */
#define STFS_COMMIT_FORCE   1u /* commit even if the source changed behind the mount */
#define STFS_COMMIT_DISCARD 2u /* drop the staged edits instead */

/* STFS_IOC_COMMIT: on any file or directory of a checkpoint; on the root of a
 * folder mount, commits every checkpoint. The ioctl itself returns 0 when the
 * daemon answered; `result` holds 0 or the errno of a refused commit
 * (EINVAL: an invalid edit, ESTALE: the source changed, ENOSPC, EIO...), and
 * `message` what was committed or why not. */
struct stfs_commit {
	uint32_t size;     /* in: sizeof(struct stfs_commit) == 4096 */
	uint32_t flags;    /* in: STFS_COMMIT_* */
	int32_t result;    /* out */
	uint32_t reserved;
	char message[STFS_MESSAGE_LEN]; /* out: NUL-terminated */
};

#define STFS_IOC_COMMIT _IOWR(STFS_IOC_TYPE, 2, struct stfs_commit)

/* Prefetch targets. */
#define STFS_TARGET_PAGE_CACHE 0u /* the source's pages of the tensor, in the page cache */
#define STFS_TARGET_CUDA       1u /* a CUDA device buffer, exported by IPC handle */

/* STFS_IOC_PREFETCH: on a tensor file. The ioctl returns 0 when the daemon
 * answered; `result` is 0 or an errno: ENOTTY (not a tensor file), EINVAL
 * (bad size or target), ENODEV (no CUDA driver or device), ENOMEM, EIO.
 * A CUDA buffer stays allocated until the file descriptor the ioctl was made
 * on is closed; open it with cuIpcOpenMemHandle (scripts/stfs_cuda.py). */
struct stfs_prefetch {
	uint32_t size;        /* in: sizeof(struct stfs_prefetch) == 512 */
	uint32_t target;      /* in: STFS_TARGET_* */
	int32_t device;       /* in: CUDA device ordinal */
	int32_t result;       /* out */
	uint64_t bytes;       /* out: bytes resident (page cache) or copied (CUDA) */
	uint64_t nbytes;      /* out: the tensor's byte length */
	uint64_t elapsed_ns;  /* out */
	uint64_t ipc_offset;  /* out: the tensor's offset in the exported allocation */
	uint64_t alloc_size;  /* out: the exported allocation's size */
	uint8_t ipc_handle[64]; /* out: CUipcMemHandle */
	char dtype[16];       /* out: "BF16", ... */
	uint32_t ndim;        /* out (at most 16 reported) */
	uint32_t reserved;
	uint64_t shape[16];   /* out */
	char message[240];    /* out: NUL-terminated */
};

#define STFS_IOC_PREFETCH _IOWR(STFS_IOC_TYPE, 1, struct stfs_prefetch)

#endif

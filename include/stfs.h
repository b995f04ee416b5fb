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

#endif

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
#define STFS_COMMIT_COMPACT 4u /* rewrite as the reference's save_file lays it out */

/* STFS_IOC_COMMIT: on any file or directory of a mount: commits every
 * checkpoint of the mount (all shards of a folder mount, or none). Only the
 * user who mounted and root may (EACCES). The ioctl itself returns 0 when the
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
 * (bad size or target), ENODEV (no CUDA driver or device), ENOMEM, EIO,
 * EACCES (only the user who mounted and root may prefetch).
 * Page cache: the daemon answers within a few seconds with `next`, where it
 * stopped; ask again with `offset = next` until `next == nbytes` (a FUSE
 * request cannot be interrupted, so each one is kept short).
 * CUDA: the whole tensor, through the device's pool of pinned slabs (as a
 * load, STFS_IOC_LOAD, of one tensor); the buffer stays allocated until the file
 * descriptor the ioctl was made on is closed; open it with
 * cuIpcOpenMemHandle (the Python package's stfs.cuda). */
struct stfs_prefetch {
	uint32_t size;        /* in: sizeof(struct stfs_prefetch) == 520 */
	uint32_t target;      /* in: STFS_TARGET_* */
	int32_t device;       /* in: CUDA device ordinal */
	int32_t result;       /* out */
	uint64_t bytes;       /* out: bytes of the range resident (page cache) or copied (CUDA) */
	uint64_t nbytes;      /* out: the tensor's byte length */
	uint64_t elapsed_ns;  /* out */
	uint64_t ipc_offset;  /* out: the tensor's offset in the exported allocation */
	uint64_t alloc_size;  /* out: the exported allocation's size */
	uint8_t ipc_handle[64]; /* out: CUipcMemHandle */
	char dtype[16];       /* out: "BF16", ... */
	uint32_t ndim;        /* out (at most 16 reported) */
	uint32_t flags;
	uint64_t shape[16];   /* out */
	uint64_t offset;      /* in (page cache): first byte of the tensor to bring in */
	uint64_t length;      /* in (page cache): bytes to bring in, 0: to the end */
	uint64_t next;        /* out: where the daemon stopped */
	char message[224];    /* out: NUL-terminated */
};

#define STFS_IOC_PREFETCH _IOWR(STFS_IOC_TYPE, 1, struct stfs_prefetch)

/* STFS_IOC_STATUS: on any file or directory of a mount. A page of the
 * `stfs status` report (staged changes, and the problems a commit would
 * refuse); ask again with `offset` advanced by the text received until
 * `total` bytes were read. `refused` is 1 when a commit would be refused. */
#define STFS_STATUS_TEXT_LEN 16344
#define STFS_STATUS_JSON 1u /* flags: the report as JSON */
struct stfs_status {
	uint32_t size;        /* in: sizeof(struct stfs_status) == 16376 */
	uint32_t flags;       /* in: STFS_STATUS_JSON, or 0 for text */
	uint64_t offset;      /* in */
	uint64_t total;       /* out */
	int32_t result;       /* out */
	uint32_t refused;     /* out */
	char text[STFS_STATUS_TEXT_LEN]; /* out: NUL-terminated */
};

#define STFS_IOC_STATUS _IOWR(STFS_IOC_TYPE, 3, struct stfs_status)

/* STFS_IOC_PROGRESS: on any file or directory of a mount. Answered at once,
 * while a commit runs (from another thread or process): `active` is 1 while a
 * commit writes a new file, `done` of `total` bytes of tensor data written,
 * `file` the path being written. In-place commits write little and show no
 * progress. */
struct stfs_progress {
	uint32_t size;        /* in: sizeof(struct stfs_progress) == 4096 */
	uint32_t active;      /* out */
	uint64_t done;        /* out */
	uint64_t total;       /* out */
	char file[4072];      /* out: NUL-terminated */
};

#define STFS_IOC_PROGRESS _IOWR(STFS_IOC_TYPE, 4, struct stfs_progress)

/* STFS_IOC_DAEMON: on any file or directory of a mount: the pid of the daemon
 * that serves it (anyone may ask). `stfs umount` waits for it to exit. */
struct stfs_daemon {
	uint32_t size;        /* in: sizeof(struct stfs_daemon) == 64 */
	uint32_t pid;         /* out */
	uint64_t reserved[7];
};

#define STFS_IOC_DAEMON _IOWR(STFS_IOC_TYPE, 6, struct stfs_daemon)

/* STFS_IOC_LOAD: on any file or directory of a mount (its root, usually):
 * many tensors into one device allocation, the arena, in one plan. The
 * daemon plans the byte spans of every tensor across the mount's files
 * (file order, adjacent tensors read together), makes the arena (each
 * tensor at an offset aligned to 256 bytes), and streams the bytes into it
 * through the device's pool of pinned slabs (made at the device's first
 * load, kept until unmount). A load belongs to the descriptor it was started
 * on: closing it (or STFS_LOAD_FREE) stops the load and frees the arena.
 *
 *   STFS_LOAD_NAMES  `text`: tensor names, each NUL-terminated (an empty one
 *                    ends them); any number of requests, for the next start.
 *   STFS_LOAD_GLOB   `text`: a shell pattern (`*`, `?`, `[...]`) over the names.
 *   STFS_LOAD_START  `target`, `device`: loads the names sent (ENOENT names a
 *                    missing one), else the glob's matches, else every tensor
 *                    of the mount. Answers at once: `id`, `tensors`, `bytes`,
 *                    `arena_size`, `handle`, and how far it got (as POLL).
 *   STFS_LOAD_POLL   `id`, `wait_ms` (at most 1000): waits for more to land;
 *                    the first `landed_tensors` of the table are in place,
 *                    `landed_bytes` in all, `done` once it ended. A failed
 *                    load answers `result` and `text` naming the tensor, and
 *                    lands none. With `id` 0: only `slabs_made`, `slabs_freed`, `live_arenas`.
 *   STFS_LOAD_TABLE  `id`, `offset`: a page of the table, `total` bytes in all
 *                    (join the pages' bytes): one JSON object per line, in
 *                    the order they land: {"name", "offset", "nbytes",
 *                    "dtype", "shape"}.
 *   STFS_LOAD_FREE   `id`: stops the load, frees its arena.
 *
 * `handle` is a CUipcMemHandle of the arena (STFS_TARGET_CUDA), opened with
 * cuIpcOpenMemHandle; for STFS_TARGET_HOST (tests and benchmarks: the same
 * pipeline into the daemon's memory), the daemon's pid (int32, at byte 0) and
 * the arena's address (uint64, at byte 8), little-endian, read through
 * /proc/PID/mem. Flag of STFS_LOAD_START: STFS_LOAD_THROUGH_SLABS, every chunk
 * through a slab even where the arena is host memory the daemon reads into.
 * The ioctl returns 0 when the daemon answered; `result` is 0 or an errno:
 * ENODEV (no CUDA driver or device), ENOMEM, EIO, ENOENT, EINVAL, ECANCELED,
 * EACCES (only the user who mounted and root may load). */
#define STFS_TARGET_HOST 2u
#define STFS_LOAD_NAMES 1u
#define STFS_LOAD_GLOB  2u
#define STFS_LOAD_START 3u
#define STFS_LOAD_POLL  4u
#define STFS_LOAD_TABLE 5u
#define STFS_LOAD_FREE  6u
#define STFS_LOAD_THROUGH_SLABS 1u
#define STFS_LOAD_TEXT_LEN 16184
struct stfs_load {
	uint32_t size;           /* in: sizeof(struct stfs_load) == 16376 */
	uint32_t op;             /* in: STFS_LOAD_* */
	uint64_t id;             /* in (POLL, TABLE, FREE); out (START) */
	uint32_t target;         /* in (START): STFS_TARGET_CUDA or STFS_TARGET_HOST */
	int32_t device;          /* in (START): CUDA device ordinal */
	uint32_t flags;          /* in (START): STFS_LOAD_THROUGH_SLABS */
	uint32_t wait_ms;        /* in (POLL) */
	int32_t result;          /* out */
	uint32_t done;           /* out */
	uint64_t tensors;        /* out: tensors planned */
	uint64_t bytes;          /* out: their bytes */
	uint64_t landed_tensors; /* out */
	uint64_t landed_bytes;   /* out */
	uint64_t arena_size;     /* out */
	uint64_t elapsed_ns;     /* out: from the start (to the end once done) */
	uint64_t slabs_made;     /* out: slabs the daemon made since it started */
	uint64_t slabs_freed;    /* out: ...and freed (a pool idle for load_idle_s) */
	uint64_t live_arenas;    /* out: arenas alive now */
	uint64_t offset;         /* in (TABLE) */
	uint64_t total;          /* out (TABLE) */
	uint8_t handle[64];      /* out */
	char text[STFS_LOAD_TEXT_LEN]; /* in: names or a glob; out: a table page, or why it failed */
};

#define STFS_IOC_LOAD _IOWR(STFS_IOC_TYPE, 5, struct stfs_load)

#endif

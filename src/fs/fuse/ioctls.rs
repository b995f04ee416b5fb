//! The ioctls that run long (a prefetch, a load), each on a thread of its own.

use super::*;

impl FuseAdapter {
    pub(super) fn prefetch(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        in_data: &[u8],
        reply: ReplyIoctl,
    ) {
        let Some(mut args) = PrefetchArgs::from_caller(in_data) else {
            return reply.error(failed(&FsError::Invalid(
                "STFS_IOC_PREFETCH with a bad struct size".into(),
            )));
        };
        let target = match args.target {
            TARGET_PAGE_CACHE => PrefetchTarget::PageCache,
            TARGET_CUDA => PrefetchTarget::Cuda(args.device),
            other => {
                args.result = libc::EINVAL;
                args.set_message(&format!("unknown prefetch target {other}"));
                return reply.ioctl(0, args.as_bytes());
            }
        };
        let (uid, pid) = (req.uid(), req.pid());
        let request = request!("prefetch", ino.0, fh.0);
        if let Err(e) = self.fs.allowed(uid, "prefetch") {
            args.result = request.span.in_scope(|| failed(&e)).code();
            args.set_message(&e.to_string());
            return reply.ioctl(0, args.as_bytes());
        }
        self.spawn(request, move |fs| {
            let started = Instant::now();
            // A FUSE request cannot be interrupted once the daemon has it:
            // stop when the caller is gone, and hand back a page-cache
            // request after a time slice (the client asks for the rest).
            // (A caller in another pid namespace shows as pid 0: only the
            // time limit applies to it.)
            let keep_going = || {
                (pid == 0 || !crate::checkpoint::recover::process_gone(pid))
                    && (target != PrefetchTarget::PageCache || started.elapsed() < PREFETCH_SLICE)
            };
            let req = PrefetchRequest {
                target,
                offset: args.offset,
                len: args.length,
                caller: uid,
            };
            match fs.prefetch(ino.0, fh.0, req, &keep_going) {
                Ok(p) => {
                    args.bytes = p.bytes;
                    args.nbytes = p.nbytes;
                    args.next = p.next;
                    if let Some(d) = p.dtype {
                        args.set_dtype(d.name());
                    }
                    if let Some(shape) = &p.shape {
                        // The struct holds 16 dimensions; ndim says how many
                        // there are, so a caller can tell the shape was cut.
                        args.ndim = shape.len() as u32;
                        for (dst, &d) in args.shape.iter_mut().zip(shape) {
                            *dst = d;
                        }
                        if shape.len() > args.shape.len() {
                            args.set_message(&format!(
                                "the shape has {} dimensions; the first {} are reported",
                                shape.len(),
                                args.shape.len()
                            ));
                        }
                    }
                    if let Some((handle, size)) = p.ipc {
                        args.ipc_handle = handle;
                        args.alloc_size = size;
                        args.ipc_offset = 0;
                    }
                }
                Err(e) => {
                    args.result = failed(&e).code();
                    args.set_message(&e.to_string());
                }
            }
            args.elapsed_ns = started.elapsed().as_nanos() as u64;
            reply.ioctl(0, args.as_bytes())
        });
    }

    /// STFS_IOC_LOAD, on a thread of its own (a poll may wait).
    pub(super) fn load(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        in_data: &[u8],
        reply: ReplyIoctl,
    ) {
        let Some(mut args) = LoadArgs::from_caller(in_data).map(Box::new) else {
            return reply.error(failed(&FsError::Invalid(
                "STFS_IOC_LOAD with a bad struct size".into(),
            )));
        };
        let uid = req.uid();
        self.spawn(request!("load", ino.0, fh.0), move |fs| {
            if let Err(e) = fs.load(fh.0, uid, &mut args) {
                args.result = failed(&e).code();
                args.set_text(&e.to_string());
            }
            reply.ioctl(0, args.as_bytes())
        });
    }
}

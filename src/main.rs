fn main() -> std::process::ExitCode {
    // glibc gives threads arenas of their own: the large, short-lived
    // allocations of commits made on threads of their own then stay spread
    // over arenas and the daemon's memory grows by each commit (measured with
    // scripts/bench_memory.py --metadata: +40% after eight commits; two
    // arenas keep it flat).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter, before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    stfs::cli::main()
}

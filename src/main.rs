fn main() -> std::process::ExitCode {
    stfs::cli::main()
}

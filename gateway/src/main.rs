fn main() -> std::process::ExitCode {
    effectgate::cli::main()
}

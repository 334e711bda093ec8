//! The `effectgate` command (see [`effectgate::cli`]).

/// mimalloc instead of the system allocator: the request path allocates
/// small buffers on every worker thread, where glibc's arenas contend
/// (see README "Benchmark").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    effectgate::cli::main()
}

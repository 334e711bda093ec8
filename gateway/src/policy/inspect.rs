//! Load-time inspection of a policy component, for errors that name the
//! cause: the memory it starts with, another world version it targets,
//! imports the host doesn't provide.

use wasmtime::Engine;
use wasmtime::component::Component;

use super::bindings;

/// The initial size of all the linear memories the core modules of the
/// component define, together, in bytes (a call's memories share
/// `policy.memory_bytes`; 0 if it can't be read: compiling reports that).
pub(super) fn initial_memory_bytes(bytes: &[u8]) -> u64 {
    let mut total = 0u64;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        match payload {
            Ok(wasmparser::Payload::MemorySection(section)) => {
                for m in section.into_iter().flatten() {
                    let page = m.page_size_log2.map_or(64 * 1024, |l| 1u64 << l.min(16));
                    total = total.saturating_add(m.initial.saturating_mul(page));
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    total
}

/// The policy-world names a component imports or exports under a version
/// other than ours or an earlier one we still load, if any.
pub(super) fn other_world(engine: &Engine, component: &Component) -> Option<String> {
    let ty = component.component_type();
    let mut names: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_owned()).collect();
    names.extend(ty.exports(engine).map(|(n, _)| n.to_owned()));
    let known: Vec<&str> = std::iter::once(bindings::WORLD)
        .chain(bindings::EARLIER_WORLDS.iter().copied())
        .filter_map(|w| w.rsplit('@').next())
        .collect();
    let other: Vec<String> = names
        .into_iter()
        .filter(|n| {
            n.starts_with("effectgate:policy/")
                && !n.rsplit_once('@').is_some_and(|(_, v)| known.contains(&v))
        })
        .collect();
    (!other.is_empty()).then(|| other.join(", "))
}

/// Whether the component exports `compensate` (world 0.2.0 and later).
pub(super) fn exports_compensate(engine: &Engine, component: &Component) -> bool {
    component
        .component_type()
        .exports(engine)
        .any(|(n, _)| n == "compensate")
}

/// The WASI interfaces the host links (any 0.2.x version), as
/// `add_wasi_without_io_access` does.
const PROVIDED_WASI: &[&str] = &[
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
    "wasi:clocks/wall-clock",
    "wasi:clocks/monotonic-clock",
    "wasi:random/random",
    "wasi:random/insecure",
    "wasi:random/insecure-seed",
    "wasi:cli/exit",
    "wasi:cli/environment",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-input",
    "wasi:cli/terminal-output",
    "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout",
    "wasi:cli/terminal-stderr",
];

/// The policy world's own interfaces, as a component imports them (this
/// version and the earlier ones the host links too).
const PROVIDED_POLICY: &[&str] = &[
    "effectgate:policy/types@0.2.0",
    "effectgate:policy/log@0.2.0",
    "effectgate:policy/clock@0.2.0",
    "effectgate:policy/types@0.1.0",
    "effectgate:policy/log@0.1.0",
    "effectgate:policy/clock@0.1.0",
];

/// Imports of `component` that the host does not provide.
pub(super) fn unprovided_imports(engine: &Engine, component: &Component) -> Vec<String> {
    component
        .component_type()
        .imports(engine)
        .map(|(n, _)| n.to_owned())
        .filter(|n| {
            if PROVIDED_POLICY.contains(&n.as_str()) {
                return false;
            }
            match n.split_once('@') {
                Some((iface, version)) => {
                    !(PROVIDED_WASI.contains(&iface) && version.starts_with("0.2."))
                }
                None => true,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memories of every core module count together, in the module's
    /// page size.
    #[test]
    fn the_initial_memory_is_the_sum_of_the_memories() {
        let one = wat::parse_str("(component (core module (memory 2)))").unwrap();
        assert_eq!(initial_memory_bytes(&one), 2 * 65_536);
        let two = wat::parse_str(
            "(component (core module (memory 2)) (core module (memory 1) (memory 3)))",
        )
        .unwrap();
        assert_eq!(initial_memory_bytes(&two), 6 * 65_536);
    }
}

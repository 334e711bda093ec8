//! Loading policy components: the disk cache of compiled modules
//! (`policy.cache_dir`), and the errors for a component of another world
//! version, one importing what the host does not provide, and one whose
//! memory is above the limit.

use effectgate::config::PolicyLimitsSpec;
use effectgate::policy::{LoadError, LoadOrigin, PolicyEngine, PolicyFailure};
use effectgate_tests::*;

fn limits(cache: Option<&std::path::Path>) -> PolicyLimitsSpec {
    PolicyLimitsSpec {
        pooling: false,
        cache_dir: cache.map(|p| p.to_path_buf()),
        ..Default::default()
    }
}

fn schema_of(engine: &PolicyEngine, module: &str) -> (LoadOrigin, String) {
    let c = engine.load(&policy_wasm(module)).unwrap();
    (c.origin, c.config_schema.clone())
}

#[test]
fn a_restart_with_a_warm_disk_cache_loads_without_compiling() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("compiled");
    let first = PolicyEngine::new(&limits(Some(&cache))).unwrap();
    let (origin, schema) = schema_of(&first, "amount_threshold");
    assert_eq!(origin, LoadOrigin::Compiled);
    let hash = first.load(&policy_wasm("amount_threshold")).unwrap().hash;
    let entry = first.cache_entry(&hash).unwrap();
    assert!(entry.is_file(), "{} written", entry.display());
    assert!(
        entry
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&hex(&hash)),
        "keyed by the module's content hash: {}",
        entry.display()
    );

    // A new engine (a restart) with the same settings: from the cache, and
    // the module behaves the same.
    let second = PolicyEngine::new(&limits(Some(&cache))).unwrap();
    let (origin, again) = schema_of(&second, "amount_threshold");
    assert_eq!(origin, LoadOrigin::DiskCache);
    assert_eq!(again, schema);

    // Other engine settings (another memory limit) get their own entry.
    let other = PolicyEngine::new(&PolicyLimitsSpec {
        memory_bytes: 8 << 20,
        ..limits(Some(&cache))
    })
    .unwrap();
    assert_eq!(
        schema_of(&other, "amount_threshold").0,
        LoadOrigin::Compiled
    );
    assert_ne!(other.cache_entry(&hash), Some(entry));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn a_corrupted_cache_entry_is_recompiled_never_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().to_path_buf();
    let warm = || {
        let e = PolicyEngine::new(&limits(Some(&cache))).unwrap();
        let c = e.load(&policy_wasm("amount_threshold")).unwrap();
        (c.origin, e.cache_entry(&c.hash).unwrap())
    };
    let (_, entry) = warm();
    let good = std::fs::read(&entry).unwrap();

    // A flipped byte in the compiled code, a truncated file, an empty file,
    // and the entry of another module under this module's name.
    let mut flipped = good.clone();
    let last = flipped.len() - 100;
    flipped[last] ^= 0x40;
    let other_module = {
        let e = PolicyEngine::new(&limits(Some(&cache))).unwrap();
        let c = e.load(&policy_wasm("replay_matrix")).unwrap();
        std::fs::read(e.cache_entry(&c.hash).unwrap()).unwrap()
    };
    for (what, bytes) in [
        ("flipped byte", flipped),
        ("truncated", good[..good.len() / 2].to_vec()),
        ("empty", Vec::new()),
        ("another module's entry", other_module),
    ] {
        std::fs::write(&entry, &bytes).unwrap();
        let (origin, again) = warm();
        assert_eq!(origin, LoadOrigin::Compiled, "{what}: recompiled");
        assert_eq!(again, entry);
        assert_eq!(
            std::fs::read(&entry).unwrap(),
            good,
            "{what}: replaced by a sound entry"
        );
        assert_eq!(warm().0, LoadOrigin::DiskCache, "{what}: then used");
    }
}

#[test]
fn an_entry_compiled_by_another_engine_is_refused_by_wasmtime() {
    // A sound file (header and digest match) whose payload another engine
    // configuration compiled: wasmtime's own check refuses it.
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().to_path_buf();
    let small = PolicyEngine::new(&PolicyLimitsSpec {
        memory_bytes: 8 << 20,
        ..limits(Some(&cache))
    })
    .unwrap();
    let c = small.load(&policy_wasm("amount_threshold")).unwrap();
    let foreign = small.cache_entry(&c.hash).unwrap();
    let engine = PolicyEngine::new(&limits(Some(&cache))).unwrap();
    let ours = engine.cache_entry(&c.hash).unwrap();
    std::fs::copy(&foreign, &ours).unwrap();
    let loaded = engine.load(&policy_wasm("amount_threshold")).unwrap();
    assert_eq!(loaded.origin, LoadOrigin::Compiled);
    assert_ne!(
        std::fs::read(&ours).unwrap(),
        std::fs::read(&foreign).unwrap(),
        "rewritten with this engine's artifact"
    );
}

#[test]
fn the_gateway_names_policy_cache_dir_when_it_cannot_create_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let err = PolicyEngine::new(&limits(Some(&file.join("cache")))).unwrap_err();
    assert!(
        format!("{err:#}").starts_with("policy.cache_dir: cannot create"),
        "{err:#}"
    );
}

#[test]
fn a_component_of_another_world_version_is_refused_naming_both_versions() {
    let engine = PolicyEngine::new(&limits(None)).unwrap();
    let err = engine.load(&policy_wasm("other_world")).unwrap_err();
    assert!(matches!(err, LoadError::OtherWorld { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("effectgate:policy/clock@0.9.0"), "{text}");
    assert!(text.contains("effectgate:policy@0.2.0"), "{text}");
}

#[test]
fn a_component_importing_the_filesystem_is_refused_naming_the_import() {
    let engine = PolicyEngine::new(&limits(None)).unwrap();
    let err = engine.load(&policy_wasm("fs_reader")).unwrap_err();
    let LoadError::UnprovidedImports { imports } = &err else {
        panic!("{err}");
    };
    assert!(
        imports.iter().any(|i| i.starts_with("wasi:filesystem/")),
        "{imports:?}"
    );
    assert!(
        imports.iter().all(|i| !i.starts_with("wasi:cli/")),
        "only what is missing: {imports:?}"
    );
    assert!(err.to_string().contains("does not provide"), "{err}");
}

#[test]
fn a_memory_limit_below_the_initial_memory_names_the_limit_and_the_size() {
    let engine = PolicyEngine::new(&PolicyLimitsSpec {
        memory_bytes: 64 * 1024,
        ..limits(None)
    })
    .unwrap();
    let err = engine.load(&policy_wasm("amount_threshold")).unwrap_err();
    let LoadError::MemoryLimit { limit, requested } = err else {
        panic!("{err}");
    };
    assert_eq!(limit, 64 * 1024);
    assert!(requested > 64 * 1024, "{requested}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("asks for {requested} bytes")),
        "{text}"
    );
    assert!(text.contains("policy.memory_bytes is 65536"), "{text}");
}

#[test]
fn a_policy_growing_past_the_limit_fails_naming_the_limit_and_the_size() {
    for pooling in [false, true] {
        // A deadline the hog can't reach first: it touches every page it
        // gets, slower without the pool's resident slots.
        let engine = PolicyEngine::new(&PolicyLimitsSpec {
            pooling,
            deadline_ms: 1000,
            ..limits(None)
        })
        .unwrap();
        let hog = engine.load(&policy_wasm("memory_hog")).unwrap();
        let request = effectgate::policy::Request {
            tenant: "t".into(),
            principal: "t:c".into(),
            route: "r".into(),
            effect_class: effectgate::policy::WitEffectClass::Payment,
            method: "POST".into(),
            path: "/".into(),
            query: None,
            headers: vec![],
            body: b"{}".to_vec(),
            operation_id: "k".into(),
            fingerprint: "0".repeat(64),
            existing_state: None,
        };
        let failure = engine
            .call(&hog, "t/memory_hog", |p, s| {
                p.call_evaluate(s, "{}", &request)
            })
            .unwrap_err();
        let PolicyFailure::OutOfMemory { limit, requested } = failure else {
            panic!("pooling {pooling}: {failure}");
        };
        assert_eq!(limit, 16 << 20);
        assert!(requested > limit, "{requested}");
        let text = failure.to_string();
        assert!(
            text.contains(&format!("asked for {requested} bytes"))
                && text.contains("policy.memory_bytes is 16777216"),
            "{text}"
        );
    }
}

//! The gateway process's allocator asks for no transparent huge pages.
//!
//! mimalloc, the binary's allocator, marks its regions `MADV_HUGEPAGE`
//! unless it is built with `no_thp`. Where the kernel's THP `defrag`
//! setting is `madvise` (Debian's default), a page fault in such a region
//! may first compact memory, and a process whose heap grows stalls for
//! tens of milliseconds at a time (README "Benchmark", "Huge pages"). The
//! kernel lists a region so marked with `hg` among its `VmFlags` in
//! `/proc/PID/smaps` (proc(5)).

#![cfg(target_os = "linux")]

mod common;
use common::{sha, spawn_gateway};

const CLIENT_KEY: &str = "thp-client-key";

/// The mappings of `pid` whose `VmFlags` carry `hg` (`MADV_HUGEPAGE`), as
/// their header lines.
fn huge_page_mappings(pid: u32) -> Vec<String> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut header = String::new();
    let mut marked = Vec::new();
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if flags.split_whitespace().any(|f| f == "hg") {
                marked.push(header.clone());
            }
        } else if line.split_whitespace().next().is_some_and(|a| {
            // A mapping's header starts with its address range.
            a.contains('-') && a.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        }) {
            header = line.to_owned();
        }
    }
    marked
}

#[tokio::test]
async fn no_region_of_the_gateway_is_marked_for_huge_pages() {
    let mock = mock_provider::spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gw = spawn_gateway(
        |proxy, admin| {
            let cfg = format!(
                "[listen]\nproxy = \"127.0.0.1:{proxy}\"\nadmin = \"127.0.0.1:{admin}\"\n\
                 [storage]\npath = \"{db}\"\n\
                 [[tenants]]\nid = \"t\"\nkeys = [{{ role = \"client\", sha256 = \"{ck}\" }}]\n\
                 [[routes]]\nname = \"pass\"\nprefix = \"/pass/\"\nupstream = \"{up}\"\nmode = \"pass\"\n",
                db = dir.path().join("ledger.db").display(),
                ck = sha(CLIENT_KEY),
                up = mock.url(),
            );
            let p = dir.path().join("effectgate.toml");
            std::fs::write(&p, cfg).unwrap();
            p
        },
        &[],
        None,
    )
    .await;
    // Some traffic, so the heap has grown past its first regions.
    let http = reqwest::Client::new();
    for _ in 0..200 {
        let r = http
            .post(format!("http://127.0.0.1:{}/pass/v1/charges", gw.proxy))
            .bearer_auth(CLIENT_KEY)
            .json(&serde_json::json!({ "amount": 100, "currency": "eur" }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(mock.provider.effects(), 200);
    let marked = huge_page_mappings(gw.child.id());
    assert!(
        marked.is_empty(),
        "regions marked MADV_HUGEPAGE (VmFlags hg): {marked:#?}"
    );
}

//! `wasi:io/poll` as policies get it: what is ready now is ready, and
//! a wait traps (see [`NoWait`]).

use wasmtime::component::ResourceTable;

/// `wasi:io/poll` for policies, which decide without waiting: a
/// pollable that is ready now is ready, and waiting on one that isn't
/// (`block`, or `poll` with none ready: `std::thread::sleep` in Rust, a
/// timer in another language) traps. A wait would happen in the host,
/// where the CPU deadline can't interrupt it, holding the call's permit
/// and pool slot for as long as the policy asked.
pub(super) struct NoWait;

impl wasmtime::component::HasData for NoWait {
    type Data<'a> = NoWaitPoll<'a>;
}

/// The resource table behind [`NoWait`].
pub(super) struct NoWaitPoll<'a>(pub(super) &'a mut ResourceTable);

impl NoWaitPoll<'_> {
    /// Whether the pollable `rep` is ready now. A timer already due (a
    /// zero or past deadline) reports ready only on its second look (its
    /// first yields once to the runtime), so it is looked at twice.
    fn due(&mut self, rep: u32) -> wasmtime::Result<bool> {
        use wasmtime_wasi::p2::bindings::sync::io::poll::HostPollable as _;
        let borrowed = || wasmtime::component::Resource::new_borrow(rep);
        Ok(self.ready(borrowed())? || self.ready(borrowed())?)
    }
}

/// The trap of a policy that tried to wait.
fn waited() -> wasmtime::Error {
    wasmtime::Error::msg(
        "the policy tried to wait (wasi:io/poll on a pollable that isn't ready, such as a sleep): \
         a policy decides without waiting",
    )
}

impl wasmtime_wasi::p2::bindings::sync::io::poll::HostPollable for NoWaitPoll<'_> {
    fn ready(
        &mut self,
        pollable: wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>,
    ) -> wasmtime::Result<bool> {
        wasmtime_wasi::p2::bindings::sync::io::poll::HostPollable::ready(self.0, pollable)
    }

    fn block(
        &mut self,
        pollable: wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>,
    ) -> wasmtime::Result<()> {
        if self.due(pollable.rep())? {
            Ok(())
        } else {
            Err(waited())
        }
    }

    fn drop(
        &mut self,
        pollable: wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>,
    ) -> wasmtime::Result<()> {
        wasmtime_wasi::p2::bindings::sync::io::poll::HostPollable::drop(self.0, pollable)
    }
}

impl wasmtime_wasi::p2::bindings::sync::io::poll::Host for NoWaitPoll<'_> {
    fn poll(
        &mut self,
        pollables: Vec<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>>,
    ) -> wasmtime::Result<Vec<u32>> {
        let mut ready = Vec::new();
        for (i, p) in (0u32..).zip(&pollables) {
            if self.due(p.rep())? {
                ready.push(i);
            }
        }
        if ready.is_empty() {
            return Err(waited());
        }
        Ok(ready)
    }
}

//! The Model Context Protocol: its wire format ([`protocol`]). The use
//! case is [`crate::ops::mcp`], the transport [`crate::http::mcp`].

pub mod protocol;

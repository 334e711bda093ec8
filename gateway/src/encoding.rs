//! Content codings of replayed answers (RFC 9110 §8.4, §12.5.3).
//!
//! An effectful call's response body is stored exactly as the provider
//! sent it, with its `Content-Encoding` and `Vary`. A duplicate gets those
//! bytes back when its `Accept-Encoding` accepts every coding applied;
//! otherwise the proxy listener (`http::encoding::decode_replays`) decodes the body (gzip, deflate, br) before
//! it leaves the gateway, drops `Content-Encoding`, and adds
//! `Accept-Encoding` to `Vary`. A request without `Accept-Encoding` is
//! treated as accepting only `identity`: the stored coding is what the
//! *first* caller asked for, and a client that didn't ask (curl without
//! `--compressed`) can't be assumed to decode it.

use std::io::Read;

/// Codings decoded at most for one replay (`gzip, br`, …); more is refused.
const MAX_CODINGS: usize = 4;

/// Whether `accept_encoding` (the request's header values, joined) accepts
/// `coding`: listed with q > 0, or `*` with q > 0 and not itself refused
/// with q = 0. `identity` is acceptable unless refused (§12.5.3).
pub fn accepts(accept_encoding: Option<&str>, coding: &str) -> bool {
    let coding = coding.trim().to_ascii_lowercase();
    let coding = match coding.as_str() {
        "x-gzip" => "gzip".to_owned(),
        _ => coding,
    };
    let Some(list) = accept_encoding else {
        return coding == "identity";
    };
    let mut star: Option<bool> = None;
    let mut identity_refused = false;
    for item in list.split(',') {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        if name.is_empty() {
            continue;
        }
        let q = parts
            .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
            .filter_map(|v| v.trim().parse::<f32>().ok())
            .next()
            .unwrap_or(1.0);
        let name = if name == "x-gzip" {
            "gzip".to_owned()
        } else {
            name
        };
        if name == coding {
            return q > 0.0;
        }
        if name == "*" {
            star = Some(q > 0.0);
        }
        if name == "identity" && q <= 0.0 {
            identity_refused = true;
        }
    }
    match star {
        Some(ok) => ok,
        None => coding == "identity" && !identity_refused,
    }
}

/// Decodes `body` encoded with `codings` (a `Content-Encoding` value: the
/// codings in the order they were applied), into at most `limit` bytes.
///
/// Errors: an unknown coding, corrupt data, or a result over `limit`.
pub fn decode(codings: &str, body: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    if codings.split(',').count() > MAX_CODINGS {
        return Err(format!("more than {MAX_CODINGS} content codings"));
    }
    let mut data = body.to_vec();
    for coding in codings.split(',').rev() {
        let coding = coding.trim().to_ascii_lowercase();
        data = match coding.as_str() {
            "" | "identity" => data,
            "gzip" | "x-gzip" => read_limited(flate2::read::MultiGzDecoder::new(&data[..]), limit)?,
            // "deflate" is zlib (RFC 9110 §8.4.1.2); some servers send raw
            // deflate, so that is tried when the zlib header is absent.
            "deflate" => match read_limited(flate2::read::ZlibDecoder::new(&data[..]), limit) {
                Ok(d) => d,
                Err(_) => read_limited(flate2::read::DeflateDecoder::new(&data[..]), limit)?,
            },
            "br" => read_limited(brotli::Decompressor::new(&data[..], 4096), limit)?,
            other => return Err(format!("unknown content coding {other:?}")),
        };
    }
    Ok(data)
}

fn read_limited(r: impl Read, limit: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    r.take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("the stored body can't be decoded: {e}"))?;
    if out.len() > limit {
        return Err(format!(
            "the decoded body is over limits.max_decoded_replay_bytes ({limit} bytes)"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn accept_encoding_rules() {
        assert!(accepts(Some("gzip, deflate, br"), "gzip"));
        assert!(accepts(Some("GZIP"), "gzip"));
        assert!(accepts(Some("x-gzip"), "gzip"));
        assert!(!accepts(Some("gzip;q=0, br"), "gzip"));
        assert!(accepts(Some("*"), "br"));
        assert!(!accepts(Some("*;q=0"), "br"));
        assert!(!accepts(Some("br, *;q=0.5, gzip;q=0"), "gzip"));
        assert!(!accepts(None, "gzip"));
        assert!(accepts(None, "identity"));
        assert!(accepts(Some(""), "identity"));
        assert!(!accepts(Some(""), "gzip"));
        assert!(!accepts(Some("identity;q=0"), "identity"));
        assert!(!accepts(Some("deflate"), "gzip"));
    }

    #[test]
    fn decodes_each_coding_and_chains_in_reverse() {
        let plain = br#"{"id":"ch_1","amount":100}"#.repeat(50);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&plain).unwrap();
        let gz = gz.finish().unwrap();
        assert_eq!(decode("gzip", &gz, 1 << 20).unwrap(), plain);
        let mut zl = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        zl.write_all(&plain).unwrap();
        let zl = zl.finish().unwrap();
        assert_eq!(decode("deflate", &zl, 1 << 20).unwrap(), plain);
        let mut raw =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        raw.write_all(&plain).unwrap();
        assert_eq!(
            decode("deflate", &raw.finish().unwrap(), 1 << 20).unwrap(),
            plain
        );
        let mut br = Vec::new();
        brotli::CompressorWriter::new(&mut br, 4096, 5, 22)
            .write_all(&plain)
            .unwrap();
        assert_eq!(decode("br", &br, 1 << 20).unwrap(), plain);
        // gzip applied first, then br: decode br, then gzip.
        let mut both = Vec::new();
        brotli::CompressorWriter::new(&mut both, 4096, 5, 22)
            .write_all(&gz)
            .unwrap();
        assert_eq!(decode("gzip, br", &both, 1 << 20).unwrap(), plain);
        // Over the limit, corrupt, unknown: errors, never a panic.
        assert!(
            decode("gzip", &gz, 10)
                .unwrap_err()
                .contains("max_decoded_replay_bytes")
        );
        assert!(decode("gzip", b"not gzip", 1 << 20).is_err());
        assert!(decode("zstd", &gz, 1 << 20).unwrap_err().contains("zstd"));
    }
}

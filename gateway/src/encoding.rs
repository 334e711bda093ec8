//! Content codings of effectful request bodies and replayed answers (RFC
//! 9110 §8.4, §12.5.3).
//!
//! An effectful call's request body in gzip, deflate or br is decoded
//! when it arrives (`http::proxy`), within the route's `max_body_bytes`:
//! its fingerprint, its contract check, its policies and the ledger all
//! see the JSON, and the provider gets it decoded, without
//! `Content-Encoding`. Any other coding is refused with 415.
//!
//! An effectful call's response body is stored exactly as the provider
//! sent it, with its `Content-Encoding` and `Vary`. A duplicate gets those
//! bytes back when its `Accept-Encoding` accepts every coding applied;
//! otherwise the proxy listener (`http::encoding::DecodeReplaysLayer`)
//! decodes the body (gzip, deflate, br) before it leaves the gateway,
//! drops `Content-Encoding`, and adds `Accept-Encoding` to `Vary`. A request without `Accept-Encoding` is
//! treated as accepting only `identity`: the stored coding is what the
//! *first* caller asked for, and a client that didn't ask (curl without
//! `--compressed`) can't be assumed to decode it.

use std::io::Read;

/// The codings [`decode`] reads, as an `Accept-Encoding` value: what a
/// 415 for a request body in another coding lists (RFC 9110 §12.5.3).
pub const REQUEST_CODINGS: &str = "gzip, deflate, br";

/// Codings decoded at most for one replay (`gzip, br`, …); more is refused.
pub const MAX_CODINGS: usize = 4;

/// Whether `accept_encoding` (the request's header values, joined) accepts
/// `coding`: listed with q > 0, or `*` with q > 0 and not itself refused
/// with q = 0. `identity` is acceptable unless refused (§12.5.3). An item
/// whose weight is no qvalue (§12.4.2: `q=abc`, `q=1.5`) is not taken.
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
        let q = match parts
            .map(str::trim)
            .find_map(|p| p.strip_prefix("q=").or(p.strip_prefix("Q=")))
        {
            None => 1.0,
            Some(v) => match qvalue(v.trim()) {
                Some(q) => q,
                // Not a qvalue (`q=abc`, `q=1.5`): the item is not taken,
                // neither as an acceptance nor as a refusal.
                None => continue,
            },
        };
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

/// A weight as RFC 9110 §12.4.2 spells it: `0` to `1` with at most three
/// decimals (`0.5`, `1.000`); `None` for anything else.
fn qvalue(v: &str) -> Option<f32> {
    let (int, frac) = v.split_once('.').unwrap_or((v, ""));
    let valid = frac.len() <= 3
        && frac.bytes().all(|b| b.is_ascii_digit())
        && match int {
            "0" => true,
            "1" => frac.bytes().all(|b| b == b'0'),
            _ => false,
        };
    valid.then(|| v.parse().ok()).flatten()
}

/// Why [`decode`] could not decode a body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// More than [`MAX_CODINGS`] codings are listed.
    #[error("more than {MAX_CODINGS} content codings")]
    TooManyCodings,
    /// A coding other than gzip (x-gzip), deflate, br and identity.
    #[error("unknown content coding {0:?}")]
    UnknownCoding(String),
    /// The data is not valid for its coding.
    #[error("the body can't be decoded as {coding}: {detail}")]
    Corrupt {
        /// The coding that failed.
        coding: String,
        /// The decoder's error.
        detail: String,
    },
    /// The decoded body would be over the limit given to [`decode`].
    #[error("the decoded body is over {limit} bytes")]
    OverLimit {
        /// The limit, in bytes.
        limit: usize,
    },
}

/// Decodes `body` encoded with `codings` (a `Content-Encoding` value: the
/// codings in the order they were applied, RFC 9110 §8.4), into at most
/// `limit` bytes. Codings: gzip (and x-gzip), deflate (zlib, or raw
/// deflate without the zlib header), br, identity.
///
/// Errors: [`DecodeError`]: too many codings, an unknown coding, corrupt
/// data, or a result over `limit`.
pub fn decode(codings: &str, body: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    // Empty list elements are no codings (RFC 9110 §5.6.1), nor is
    // `identity`.
    let applied: Vec<String> = codings
        .split(',')
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty() && c != "identity")
        .collect();
    if applied.len() > MAX_CODINGS {
        return Err(DecodeError::TooManyCodings);
    }
    let mut data = body.to_vec();
    for coding in applied.into_iter().rev() {
        data = match coding.as_str() {
            "gzip" | "x-gzip" => read_limited(
                &mut flate2::read::MultiGzDecoder::new(&data[..]),
                &coding,
                limit,
            )?,
            "deflate" => inflate(&data, limit)?,
            "br" => unbrotli(&data, limit)?,
            _ => return Err(DecodeError::UnknownCoding(coding)),
        };
    }
    Ok(data)
}

/// `deflate`: zlib (RFC 9110 §8.4.1.2), or raw deflate when the zlib
/// header is absent (some servers send that). Bytes after the end of the
/// stream are refused, as gzip's decoder refuses them.
fn inflate(data: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    let whole = |out: Vec<u8>, used: u64| {
        let left = data.len() as u64 - used.min(data.len() as u64);
        if left == 0 {
            Ok(out)
        } else {
            Err(DecodeError::Corrupt {
                coding: "deflate".into(),
                detail: format!("{left} bytes after the end of the compressed data"),
            })
        }
    };
    let mut zlib = flate2::read::ZlibDecoder::new(data);
    match read_limited(&mut zlib, "deflate", limit) {
        Ok(out) => whole(out, zlib.total_in()),
        Err(DecodeError::Corrupt { .. }) => {
            let mut raw = flate2::read::DeflateDecoder::new(data);
            let out = read_limited(&mut raw, "deflate", limit)?;
            whole(out, raw.total_in())
        }
        Err(e) => Err(e),
    }
}

/// `br` (RFC 7932), the whole body given at once so that bytes after the
/// end of the stream are seen and refused, as gzip's and deflate's are (a
/// reader over the body would stop at the stream's end and leave them
/// unread). Only RFC 7932's windows (at most 16 MiB) are accepted: a
/// "large window" stream (up to 1 GiB, an extension) is corrupt here. The
/// decoder hands output over when its window is full or the stream ends,
/// so the body is refused once past `limit`, after at most one window of
/// output beyond it.
fn unbrotli(data: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    use brotli::BrotliResult;
    use brotli::reader::StandardAlloc;
    let corrupt = |detail: String| DecodeError::Corrupt {
        coding: "br".into(),
        detail,
    };
    let mut state = brotli::BrotliState::new_strict(
        StandardAlloc::default(),
        StandardAlloc::default(),
        StandardAlloc::default(),
    );
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    let (mut available_in, mut input_offset, mut total_out) = (data.len(), 0, 0);
    loop {
        let (mut available_out, mut output_offset) = (chunk.len(), 0);
        let result = brotli::BrotliDecompressStream(
            &mut available_in,
            &mut input_offset,
            data,
            &mut available_out,
            &mut output_offset,
            &mut chunk,
            &mut total_out,
            &mut state,
        );
        out.extend_from_slice(&chunk[..output_offset]);
        if out.len() > limit {
            return Err(DecodeError::OverLimit { limit });
        }
        match result {
            BrotliResult::ResultSuccess => break,
            BrotliResult::NeedsMoreOutput => {}
            BrotliResult::NeedsMoreInput => {
                return Err(corrupt(
                    "the data ends before the end of the compressed stream".into(),
                ));
            }
            BrotliResult::ResultFailure => return Err(corrupt("invalid compressed data".into())),
        }
    }
    if available_in > 0 {
        return Err(corrupt(format!(
            "{available_in} bytes after the end of the compressed data"
        )));
    }
    Ok(out)
}

fn read_limited(r: &mut impl Read, coding: &str, limit: usize) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    r.take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| DecodeError::Corrupt {
            coding: coding.to_owned(),
            detail: e.to_string(),
        })?;
    if out.len() > limit {
        return Err(DecodeError::OverLimit { limit });
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
        // A weight that is no qvalue (RFC 9110 §12.4.2) takes the item out.
        for bad in [
            "gzip;q=abc",
            "gzip;q=1.5",
            "gzip;q=2",
            "gzip;q=0.1234",
            "gzip;q=",
        ] {
            assert!(!accepts(Some(bad), "gzip"), "{bad}");
        }
        assert!(accepts(Some("gzip;q=0.001"), "gzip"));
        assert!(accepts(Some("gzip;q=1.000"), "gzip"));
        assert!(accepts(Some("gzip; q=0.5"), "gzip"));
        assert!(accepts(Some("identity;q=x"), "identity"));
        assert_eq!(qvalue("0.25"), Some(0.25));
        assert_eq!(qvalue("1.001"), None);
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
        let raw = raw.finish().unwrap();
        assert_eq!(decode("deflate", &raw, 1 << 20).unwrap(), plain);
        // Bytes after the end of the stream are refused, for zlib and raw
        // deflate as for gzip.
        for (coding, stream) in [("deflate", &zl), ("deflate", &raw), ("gzip", &gz)] {
            let mut trailing = stream.clone();
            trailing.extend_from_slice(b"garbage");
            assert!(
                matches!(
                    decode(coding, &trailing, 1 << 20),
                    Err(DecodeError::Corrupt { .. })
                ),
                "{coding}"
            );
        }
        let mut br = Vec::new();
        brotli::CompressorWriter::new(&mut br, 4096, 5, 22)
            .write_all(&plain)
            .unwrap();
        assert_eq!(decode("br", &br, 1 << 20).unwrap(), plain);
        // br too refuses bytes after its stream, a stream cut short, and
        // output past the limit.
        let mut trailing = br.clone();
        trailing.extend_from_slice(b"garbage");
        assert_eq!(
            decode("br", &trailing, 1 << 20).unwrap_err(),
            DecodeError::Corrupt {
                coding: "br".into(),
                detail: "7 bytes after the end of the compressed data".into()
            }
        );
        assert!(matches!(
            decode("br", &br[..br.len() - 1], 1 << 20).unwrap_err(),
            DecodeError::Corrupt { coding, .. } if coding == "br"
        ));
        assert_eq!(
            decode("br", &br, 100).unwrap_err(),
            DecodeError::OverLimit { limit: 100 }
        );
        assert_eq!(decode("br", &br, plain.len()).unwrap(), plain);
        // A large body decodes across many output chunks.
        let big: Vec<u8> = (0..200_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let mut big_br = Vec::new();
        brotli::CompressorWriter::new(&mut big_br, 4096, 5, 22)
            .write_all(&big)
            .unwrap();
        assert_eq!(decode("br", &big_br, 1 << 20).unwrap(), big);
        // A large-window stream (not RFC 7932's br) is refused, whatever
        // it holds: its window alone could be 1 GiB.
        let mut large = Vec::new();
        let params = brotli::enc::BrotliEncoderParams {
            large_window: true,
            lgwin: 26,
            ..Default::default()
        };
        brotli::enc::BrotliCompress(&mut &plain[..], &mut large, &params).unwrap();
        assert!(matches!(
            decode("br", &large, 1 << 20).unwrap_err(),
            DecodeError::Corrupt { coding, .. } if coding == "br"
        ));
        // gzip applied first, then br: decode br, then gzip.
        let mut both = Vec::new();
        brotli::CompressorWriter::new(&mut both, 4096, 5, 22)
            .write_all(&gz)
            .unwrap();
        assert_eq!(decode("gzip, br", &both, 1 << 20).unwrap(), plain);
        // Over the limit, corrupt, unknown: errors, never a panic.
        assert_eq!(
            decode("gzip", &gz, 10).unwrap_err(),
            DecodeError::OverLimit { limit: 10 }
        );
        assert!(matches!(
            decode("gzip", b"not gzip", 1 << 20).unwrap_err(),
            DecodeError::Corrupt { coding, .. } if coding == "gzip"
        ));
        assert_eq!(
            decode("zstd", &gz, 1 << 20).unwrap_err(),
            DecodeError::UnknownCoding("zstd".into())
        );
    }
}

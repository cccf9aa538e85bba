//! A response as the store keeps it for replay.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

/// Headers never kept, whatever the configuration: they describe one connection or one
/// transfer, not the response.
const PER_TRANSFER: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "date",
];

/// Headers that describe a body: a replay whose body was not kept has none. A digest among
/// them would not match the empty body a client checks it against.
const ABOUT_THE_BODY: [&str; 11] = [
    "content-type",
    "content-encoding",
    "content-range",
    "content-language",
    "content-disposition",
    "etag",
    "last-modified",
    "content-digest",
    "repr-digest",
    "content-md5",
    "digest",
];

/// Headers kept only when the layer is told to: they carry a session or credentials that a
/// replay must not hand to whoever sends the key again.
const SENSITIVE: [HeaderName; 3] = [
    header::SET_COOKIE,
    header::AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// A stored response (the layer's own; public only as part of the sealed [`Backend`](super::Backend)).
#[derive(Debug)]
#[doc(hidden)]
pub struct Record {
    pub(crate) fingerprint: String,
    pub(crate) status: u16,
    /// Name and raw value of each kept header, in order.
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    /// `None` when it was over the size limit and not kept.
    pub(crate) body: Option<Vec<u8>>,
    /// Why it cannot be replayed, when its row holds a status or headers no response has.
    pub(crate) damaged: Option<String>,
}

impl Record {
    /// What of `status`, `headers` and `body` is kept.
    pub(crate) fn of(
        fingerprint: String,
        status: StatusCode,
        headers: &HeaderMap,
        body: Option<&[u8]>,
        keep_sensitive: bool,
    ) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| !PER_TRANSFER.contains(&name.as_str()))
            .filter(|(name, _)| body.is_some() || !ABOUT_THE_BODY.contains(&name.as_str()))
            .filter(|(name, _)| keep_sensitive || !SENSITIVE.contains(name))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        Self {
            fingerprint,
            status: status.as_u16(),
            headers,
            body: body.map(<[u8]>::to_vec),
            damaged: None,
        }
    }

    /// The headers as stored: a JSON list of `[name, [bytes]]`, exact for any value.
    pub(crate) fn headers_json(&self) -> String {
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "[]".to_owned())
    }

    /// A record read back from its columns. One whose status or headers no response can have
    /// (a row written by hand, or damaged) says why in `damaged`: replaying it would answer
    /// something the endpoint never said. Its fingerprint still tells a reused key apart.
    pub(crate) fn stored(
        fingerprint: String,
        status: i32,
        headers: &str,
        body: Option<Vec<u8>>,
    ) -> Self {
        match Self::readable(status, headers) {
            Ok((status, headers)) => Self {
                fingerprint,
                status,
                headers,
                body,
                damaged: None,
            },
            Err(why) => Self {
                fingerprint,
                status: 0,
                headers: Vec::new(),
                body: None,
                damaged: Some(why),
            },
        }
    }

    /// The status and headers of a kept row, or why they are no response's.
    #[allow(clippy::type_complexity)]
    fn readable(status: i32, headers: &str) -> Result<(u16, Vec<(String, Vec<u8>)>), String> {
        let status = u16::try_from(status)
            .ok()
            .filter(|status| StatusCode::from_u16(*status).is_ok())
            .ok_or_else(|| format!("kept status {status} is no HTTP status"))?;
        let headers: Vec<(String, Vec<u8>)> = serde_json::from_str(headers)
            .map_err(|error| format!("kept headers are not a list of names and bytes: {error}"))?;
        for (name, value) in &headers {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("kept header name {name:?} is no header name"))?;
            HeaderValue::from_bytes(value)
                .map_err(|_| format!("kept header {name:?} has a value no header can hold"))?;
        }
        Ok((status, headers))
    }

    /// The replay: the stored status, headers and body, marked as a replay.
    pub(crate) fn replay<B: From<Bytes>>(self) -> Response<B> {
        let stored = self.body.is_some();
        let mut response = Response::new(B::from(Bytes::from(self.body.unwrap_or_default())));
        // Both checked when the record was read back.
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(&value),
            ) {
                response.headers_mut().append(name, value);
            }
        }
        response
            .headers_mut()
            .insert(super::REPLAYED, HeaderValue::from_static("true"));
        if !stored {
            response
                .headers_mut()
                .insert(super::BODY_NOT_STORED, HeaderValue::from_static("true"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::LOCATION, HeaderValue::from_static("/orders/1"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=s"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        headers
    }

    fn names(record: &Record) -> Vec<&str> {
        record
            .headers
            .iter()
            .map(|(name, _)| name.as_str())
            .collect()
    }

    #[test]
    fn cookies_and_credentials_are_kept_only_when_asked() {
        let plain = Record::of(
            String::new(),
            StatusCode::CREATED,
            &headers(),
            Some(b"{}"),
            false,
        );
        assert_eq!(names(&plain), ["location"]);
        let all = Record::of(
            String::new(),
            StatusCode::CREATED,
            &headers(),
            Some(b"{}"),
            true,
        );
        assert_eq!(names(&all), ["location", "set-cookie", "authorization"]);
    }

    #[test]
    fn a_replay_gives_back_status_headers_and_body_exactly() {
        let mut headers = HeaderMap::new();
        headers.insert("x-opaque", HeaderValue::from_bytes(&[0xfe, b'a']).unwrap());
        let record = Record::of(
            String::new(),
            StatusCode::ACCEPTED,
            &headers,
            Some(b"\x00\xff"),
            false,
        );
        let record = Record::stored(
            record.fingerprint.clone(),
            i32::from(record.status),
            &record.headers_json(),
            record.body.clone(),
        );
        assert_eq!(record.damaged, None);
        let replay: Response<Bytes> = record.replay();
        assert_eq!(replay.status(), StatusCode::ACCEPTED);
        assert_eq!(replay.headers()["x-opaque"].as_bytes(), [0xfe, b'a']);
        assert_eq!(replay.headers()[super::super::REPLAYED], "true");
        assert_eq!(replay.body().as_ref(), b"\x00\xff");
    }

    #[test]
    fn a_kept_answer_no_response_can_have_is_refused_not_replayed() {
        let read = |status: i32, headers: &str| {
            let record = Record::stored("fp".to_owned(), status, headers, None);
            assert_eq!(record.fingerprint, "fp", "kept to tell a reused key apart");
            record.damaged.map_or(Ok(()), Err)
        };
        assert_eq!(read(201, "[]"), Ok(()));
        for (status, headers) in [
            (0, "[]"),
            (70_000, "[]"),
            (-1, "[]"),
            (200, "not json"),
            (200, r#"{"location": "/x"}"#),
            (200, r#"[["bad name", [97]]]"#),
            (200, r#"[["x-line", [10]]]"#),
        ] {
            let error = read(status, headers).unwrap_err();
            assert!(error.starts_with("kept "), "{status} {headers}: {error}");
        }
    }
}

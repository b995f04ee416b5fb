//! The S3 requests a commit sends that `object_store` cannot: a multipart
//! upload whose parts are ranged server-side copies of the old object
//! (UploadPartCopy with `x-amz-copy-source-range`) mixed with uploaded
//! parts, completed only over the version the mount saw (`If-Match`).
//! Signed with object_store's own SigV4 signer and credentials and sent
//! through its HTTP client, so that credentials, endpoint, region and
//! timeouts are those of the reads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use object_store::aws::{AwsAuthorizer, AwsCredentialProvider};
use object_store::client::{HttpClient, HttpConnector, HttpRequestBody, ReqwestConnector};
use object_store::{ClientOptions, path::Path as ObjectPath};

/// Why an S3 request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum S3Error {
    /// 412: the object is not the version the request was conditional on.
    #[error("{op}: the object is not the version this mount read (HTTP 412: replaced since)")]
    Precondition { op: &'static str },
    /// The store answered with an error (possibly a 200 whose body is one).
    #[error("{op}: HTTP {status}{}{}", if code.is_empty() { String::new() } else { format!(": {code}") }, if message.is_empty() { String::new() } else { format!(": {message}") })]
    Status {
        op: &'static str,
        status: u16,
        code: String,
        message: String,
    },
    /// No answer: the connection failed, or the time ran out.
    #[error("{op}: {why}")]
    Transport { op: &'static str, why: String },
}

impl S3Error {
    /// Worth sending again: the store or the network failed, not the request.
    fn transient(&self) -> bool {
        match self {
            S3Error::Precondition { .. } => false,
            S3Error::Transport { .. } => true,
            S3Error::Status { status, code, .. } => {
                *status >= 500
                    || *status == 429
                    || code == "ConditionalRequestConflict"
                    || code == "InternalError"
                    || code == "SlowDown"
            }
        }
    }

    /// The upload id is not known to the store (completed or aborted already).
    pub fn no_such_upload(&self) -> bool {
        matches!(self, S3Error::Status { code, .. } if code == "NoSuchUpload")
    }
}

/// What the commit of one object has sent so far (for `stfs commit`, the log
/// and the tests).
#[derive(Debug, Default)]
pub struct Sent {
    pub requests: AtomicU64,
    /// Bytes of part bodies uploaded.
    pub uploaded: AtomicU64,
    /// Bytes copied by the server (UploadPartCopy).
    pub copied: AtomicU64,
}

/// A part of a multipart upload, once sent: its number and ETag.
#[derive(Debug, Clone)]
pub struct DonePart {
    pub number: u32,
    pub etag: String,
}

/// Sends the commit requests of one S3 store.
pub struct S3Writer {
    credentials: AwsCredentialProvider,
    http: HttpClient,
    region: String,
    bucket: String,
    /// `{endpoint}/{bucket}` (path style) or `https://{bucket}.s3.{region}.amazonaws.com`.
    base: String,
    timeout: Duration,
    pub sent: Arc<Sent>,
}

impl std::fmt::Debug for S3Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Writer")
            .field("base", &self.base)
            .finish()
    }
}

/// Percent-encodes a key as S3 signs it: every byte but the unreserved ones
/// (and `/` between segments, where `keep_slash`).
fn encode(key: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(key.len());
    for &b in key.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            b'/' if keep_slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// AWS's domain for a region (China's regions have their own).
fn aws_domain(region: &str) -> &'static str {
    match region.starts_with("cn-") {
        true => "amazonaws.com.cn",
        false => "amazonaws.com",
    }
}

/// The text of the first `<name>` element of an XML answer, unescaped.
pub fn xml_tag(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let start = xml.find(&open)? + open.len();
    let end = start + xml[start..].find(&close)?;
    Some(
        xml[start..end]
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl S3Writer {
    /// `endpoint`: an S3-compatible endpoint (path-style requests), else AWS.
    pub fn new(
        credentials: AwsCredentialProvider,
        options: &ClientOptions,
        region: String,
        bucket: String,
        endpoint: Option<String>,
        timeout: Duration,
    ) -> Result<S3Writer, S3Error> {
        let http =
            ReqwestConnector::default()
                .connect(options)
                .map_err(|e| S3Error::Transport {
                    op: "setting up the client",
                    why: e.to_string(),
                })?;
        let base = match endpoint {
            Some(ep) => format!("{}/{}", ep.trim_end_matches('/'), encode(&bucket, false)),
            // (A bucket name with dots fails TLS as a host name: path style.)
            None if bucket.contains('.') => {
                format!("https://s3.{region}.{}/{bucket}", aws_domain(&region))
            }
            None => format!("https://{bucket}.s3.{region}.{}", aws_domain(&region)),
        };
        Ok(S3Writer {
            credentials,
            http,
            region,
            bucket,
            base,
            timeout,
            sent: Arc::new(Sent::default()),
        })
    }

    fn url(&self, key: &ObjectPath, query: &str) -> String {
        let mut url = format!("{}/{}", self.base, encode(key.as_ref(), true));
        if !query.is_empty() {
            url.push('?');
            url.push_str(query);
        }
        url
    }

    /// One signed request, sent again (three times at most, after a pause)
    /// while it fails for a transient reason. A 200 whose body is an
    /// `<Error>` (UploadPartCopy and CompleteMultipartUpload may answer so)
    /// is an error. Returns the answer's headers and body.
    async fn send(
        &self,
        op: &'static str,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        body: Bytes,
    ) -> Result<(HeaderMap, Bytes), S3Error> {
        let mut pause = Duration::from_millis(200);
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self
                .send_once(op, &method, url, headers, body.clone())
                .await
            {
                Err(e) if attempt < 4 && e.transient() => {
                    tracing::warn!("{e}: sent again");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                done => return done,
            }
        }
    }

    async fn send_once(
        &self,
        op: &'static str,
        method: &Method,
        url: &str,
        headers: &[(&str, String)],
        body: Bytes,
    ) -> Result<(HeaderMap, Bytes), S3Error> {
        let transport = |why: String| S3Error::Transport { op, why };
        let credential = self
            .credentials
            .get_credential()
            .await
            .map_err(|e| transport(format!("credentials: {e}")))?;
        let mut builder = Request::builder().method(method.clone()).uri(url);
        for (name, value) in headers {
            builder = builder.header(*name, value);
        }
        let mut request = builder
            .body(HttpRequestBody::from(body))
            .map_err(|e| transport(e.to_string()))?;
        AwsAuthorizer::new(&credential, "s3", &self.region)
            .try_authorize(&mut request, None)
            .map_err(|e| transport(format!("signing: {e}")))?;
        self.sent.requests.fetch_add(1, Ordering::Relaxed);
        let answer = async {
            let response = self
                .http
                .execute(request)
                .await
                .map_err(|e| transport(crate::errno::with_causes(&e)))?;
            let (parts, body) = response.into_parts();
            let body = body
                .bytes()
                .await
                .map_err(|e| transport(crate::errno::with_causes(&e)))?;
            Ok::<_, S3Error>((parts, body))
        };
        // (A copy of a 1 GiB part, or the completion of a large object, may
        // take the server minutes: ten times --timeout, the client's own
        // limit; its limit on silence applies too.)
        let (parts, body) = tokio::time::timeout(self.timeout.saturating_mul(10), answer)
            .await
            .map_err(|_| transport(format!("no answer in {} s", self.timeout.as_secs() * 10)))??;
        let status = parts.status.as_u16();
        let text = String::from_utf8_lossy(&body);
        if status == 412 {
            return Err(S3Error::Precondition { op });
        }
        // (A 200 may carry an error: the body says so.)
        if status >= 300 || (method != Method::GET && text.contains("<Error>")) {
            return Err(S3Error::Status {
                op,
                status,
                code: xml_tag(&text, "Code").unwrap_or_default(),
                message: xml_tag(&text, "Message").unwrap_or_default(),
            });
        }
        Ok((parts.headers, body))
    }

    /// CreateMultipartUpload: the upload's id (`keep`: the object's own
    /// headers, which the new one gets).
    pub async fn create_upload(
        &self,
        key: &ObjectPath,
        keep: &ObjectHeaders,
    ) -> Result<String, S3Error> {
        let op = "CreateMultipartUpload";
        let headers = with_kept(Vec::new(), keep);
        let (_, body) = self
            .send(
                op,
                Method::POST,
                &self.url(key, "uploads="),
                &headers,
                Bytes::new(),
            )
            .await?;
        xml_tag(&String::from_utf8_lossy(&body), "UploadId").ok_or(S3Error::Status {
            op,
            status: 200,
            code: "NoUploadId".into(),
            message: "the answer names no upload".into(),
        })
    }

    fn part_query(number: u32, upload: &str) -> String {
        format!("partNumber={number}&uploadId={}", encode(upload, false))
    }

    /// UploadPart: `body` as part `number`.
    pub async fn upload_part(
        &self,
        key: &ObjectPath,
        upload: &str,
        number: u32,
        body: Bytes,
    ) -> Result<DonePart, S3Error> {
        let op = "UploadPart";
        let len = body.len() as u64;
        let url = self.url(key, &Self::part_query(number, upload));
        let (headers, _) = self.send(op, Method::PUT, &url, &[], body).await?;
        self.sent.uploaded.fetch_add(len, Ordering::Relaxed);
        let etag = headers
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .ok_or(S3Error::Status {
                op,
                status: 200,
                code: "NoETag".into(),
                message: "the answer gives no ETag".into(),
            })?;
        Ok(DonePart {
            number,
            etag: etag.to_string(),
        })
    }

    /// UploadPartCopy: bytes `range` of `source` (as it is at `etag`, where
    /// given) as part `number`, copied by the server.
    pub async fn copy_part(
        &self,
        key: &ObjectPath,
        upload: &str,
        number: u32,
        source: &ObjectPath,
        etag: Option<&str>,
        range: std::ops::Range<u64>,
    ) -> Result<DonePart, S3Error> {
        let op = "UploadPartCopy";
        let url = self.url(key, &Self::part_query(number, upload));
        let mut headers = vec![
            (
                "x-amz-copy-source",
                format!(
                    "/{}/{}",
                    encode(&self.bucket, false),
                    encode(source.as_ref(), true)
                ),
            ),
            (
                "x-amz-copy-source-range",
                format!("bytes={}-{}", range.start, range.end - 1),
            ),
        ];
        if let Some(etag) = etag {
            headers.push(("x-amz-copy-source-if-match", etag.to_string()));
        }
        let (_, body) = self
            .send(op, Method::PUT, &url, &headers, Bytes::new())
            .await?;
        self.sent
            .copied
            .fetch_add(range.end - range.start, Ordering::Relaxed);
        let etag = xml_tag(&String::from_utf8_lossy(&body), "ETag").ok_or(S3Error::Status {
            op,
            status: 200,
            code: "NoETag".into(),
            message: "the answer gives no ETag".into(),
        })?;
        Ok(DonePart { number, etag })
    }

    /// CompleteMultipartUpload, with `If-Match: etag` where given. Returns
    /// the new object's ETag.
    pub async fn complete(
        &self,
        key: &ObjectPath,
        upload: &str,
        parts: &[DonePart],
        if_match: Option<&str>,
    ) -> Result<String, S3Error> {
        let op = "CompleteMultipartUpload";
        let mut xml = String::from("<CompleteMultipartUpload>");
        for p in parts {
            xml.push_str(&format!(
                "<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>",
                p.number,
                xml_escape(&p.etag)
            ));
        }
        xml.push_str("</CompleteMultipartUpload>");
        let url = self.url(key, &format!("uploadId={}", encode(upload, false)));
        let headers: Vec<(&str, String)> = if_match
            .map(|e| ("if-match", e.to_string()))
            .into_iter()
            .collect();
        let (_, body) = self
            .send(op, Method::POST, &url, &headers, Bytes::from(xml))
            .await?;
        Ok(xml_tag(&String::from_utf8_lossy(&body), "ETag").unwrap_or_default())
    }

    /// AbortMultipartUpload (an upload already gone is not an error).
    pub async fn abort(&self, key: &ObjectPath, upload: &str) -> Result<(), S3Error> {
        let url = self.url(key, &format!("uploadId={}", encode(upload, false)));
        match self
            .send(
                "AbortMultipartUpload",
                Method::DELETE,
                &url,
                &[],
                Bytes::new(),
            )
            .await
        {
            Err(e) if e.no_such_upload() => Ok(()),
            done => done.map(|_| ()),
        }
    }

    /// PutObject of a whole (small) object, with `If-Match: etag` where
    /// given. Returns the new object's ETag.
    pub async fn put(
        &self,
        key: &ObjectPath,
        body: Bytes,
        if_match: Option<&str>,
        keep: &ObjectHeaders,
    ) -> Result<String, S3Error> {
        let headers: Vec<(&str, String)> = if_match
            .map(|e| ("if-match", e.to_string()))
            .into_iter()
            .collect();
        self.put_with(key, body, &with_kept(headers, keep)).await
    }

    /// PutObject of a new object: refused (`S3Error::Precondition`) if the
    /// key holds one already (`If-None-Match: *`). Returns its ETag.
    pub async fn put_new(
        &self,
        key: &ObjectPath,
        body: Bytes,
        keep: &ObjectHeaders,
    ) -> Result<String, S3Error> {
        let headers = vec![("if-none-match", "*".to_string())];
        self.put_with(key, body, &with_kept(headers, keep)).await
    }

    async fn put_with(
        &self,
        key: &ObjectPath,
        body: Bytes,
        headers: &[(&str, String)],
    ) -> Result<String, S3Error> {
        let len = body.len() as u64;
        let (headers, _) = self
            .send("PutObject", Method::PUT, &self.url(key, ""), headers, body)
            .await?;
        self.sent.uploaded.fetch_add(len, Ordering::Relaxed);
        Ok(headers
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string())
    }

    /// DeleteObject, with `If-Match: etag` where given (a store that does not
    /// know conditional deletes ignores it: the commit asked first). A key
    /// already gone is not an error (S3 answers 204 either way).
    pub async fn delete(&self, key: &ObjectPath, if_match: Option<&str>) -> Result<(), S3Error> {
        let headers: Vec<(&str, String)> = if_match
            .map(|e| ("if-match", e.to_string()))
            .into_iter()
            .collect();
        let url = self.url(key, "");
        match self
            .send("DeleteObject", Method::DELETE, &url, &headers, Bytes::new())
            .await
        {
            Err(S3Error::Status { status: 404, .. }) if if_match.is_none() => Ok(()),
            done => done.map(|_| ()),
        }
    }

    /// HeadObject: the object's ETag now (None: it is gone).
    pub async fn etag_now(&self, key: &ObjectPath) -> Result<Option<String>, S3Error> {
        let op = "HeadObject";
        match self
            .send(op, Method::HEAD, &self.url(key, ""), &[], Bytes::new())
            .await
        {
            Ok((headers, _)) => Ok(headers
                .get("etag")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)),
            Err(S3Error::Status { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// An object's own headers, which a commit gives the object that replaces
/// it: its type, encoding, language, disposition, cache policy and user
/// metadata (`x-amz-meta-*`), as a GET of it answered them.
pub type ObjectHeaders = Vec<(String, String)>;

/// Those of `attributes` (object_store's reading of a GET's headers).
pub fn object_headers(attributes: &object_store::Attributes) -> ObjectHeaders {
    use object_store::Attribute;
    attributes
        .iter()
        .filter_map(|(attribute, value)| {
            let name = match attribute {
                Attribute::ContentType => "content-type".to_string(),
                Attribute::ContentEncoding => "content-encoding".to_string(),
                Attribute::ContentLanguage => "content-language".to_string(),
                Attribute::ContentDisposition => "content-disposition".to_string(),
                Attribute::CacheControl => "cache-control".to_string(),
                Attribute::Metadata(key) => format!("x-amz-meta-{key}"),
                _ => return None,
            };
            let value: &str = value.as_ref();
            Some((name, value.to_string()))
        })
        .collect()
}

/// A request's headers, and the object's own kept.
fn with_kept<'a>(
    mut headers: Vec<(&'a str, String)>,
    keep: &'a ObjectHeaders,
) -> Vec<(&'a str, String)> {
    headers.extend(keep.iter().map(|(n, v)| (n.as_str(), v.clone())));
    headers
}

/// The ETag S3 gives an object put whole: the MD5 of its bytes, quoted.
pub fn put_etag(body: &[u8]) -> String {
    use md5::Digest;
    format!("\"{}\"", hex(&md5::Md5::digest(body)))
}

/// The ETag S3 gives a completed multipart upload: the MD5 of its parts'
/// MD5s, then `-` and the number of parts, quoted (None: a part's ETag is
/// not an MD5, as with encryption by KMS).
pub fn multipart_etag(parts: &[DonePart]) -> Option<String> {
    use md5::Digest;
    let mut all = Vec::with_capacity(16 * parts.len());
    for p in parts {
        let text = p.etag.trim_matches('"');
        if text.len() != 32 {
            return None;
        }
        for k in 0..16 {
            all.push(u8::from_str_radix(text.get(2 * k..2 * k + 2)?, 16).ok()?);
        }
    }
    Some(format!(
        "\"{}-{}\"",
        hex(&md5::Md5::digest(&all)),
        parts.len()
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_encoded_as_s3_signs_them() {
        assert_eq!(encode("a b/c+d~é", true), "a%20b/c%2Bd~%C3%A9");
        assert_eq!(encode("a/b", false), "a%2Fb");
    }

    #[test]
    fn etags_are_s3s() {
        // (Values as S3 and moto give them.)
        assert_eq!(put_etag(b""), "\"d41d8cd98f00b204e9800998ecf8427e\"");
        let parts = [DonePart {
            number: 1,
            etag: "\"d41d8cd98f00b204e9800998ecf8427e\"".into(),
        }];
        assert_eq!(
            multipart_etag(&parts).as_deref(),
            Some("\"59adb24ef3cdbe0297f05b395827453f-1\"")
        );
        let kms = [DonePart {
            number: 1,
            etag: "\"not-an-md5\"".into(),
        }];
        assert_eq!(multipart_etag(&kms), None);
    }

    #[test]
    fn xml_answers_are_read_and_unescaped() {
        let xml =
            "<?xml version=\"1.0\"?><CopyPartResult><ETag>&quot;abc&quot;</ETag></CopyPartResult>";
        assert_eq!(xml_tag(xml, "ETag").as_deref(), Some("\"abc\""));
        assert_eq!(xml_tag(xml, "Code"), None);
        let err = "<Error><Code>InternalError</Code><Message>a &amp; b</Message></Error>";
        assert_eq!(xml_tag(err, "Message").as_deref(), Some("a & b"));
    }
}

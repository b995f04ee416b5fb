//! Connecting to a store: the URL parsed, the client's time limits, the
//! store built for its scheme (S3 with the shared AWS files and an S3
//! writer for commits, GCS, Azure, HTTP), the runtime and the disk cache.

use super::*;

/// What a URL's scheme builds.
struct Built {
    store: Arc<dyn ObjectStore>,
    /// The object's path within the store (a folder's ends with `/`).
    path: String,
    /// `scheme://bucket` (or the HTTP origin).
    origin: String,
    /// What commits (S3 only).
    writer: Option<Arc<s3::S3Writer>>,
}

impl Remote {
    /// Connects to the store a URL names: `s3://bucket/key`, `s3://bucket/prefix/`,
    /// `gs://`, `az://`, `https://host/path`. Credentials and settings come from
    /// the standard environment (AWS_*, GOOGLE_*, AZURE_*).
    pub fn connect(url: &str, opts: &RemoteOptions) -> Result<Location, RemoteError> {
        let parsed =
            url::Url::parse(url).map_err(|e| RemoteError::url(url, format!("not a URL: {e}")))?;
        if parsed.query().is_some() {
            let why =
                "a URL with a query string (a presigned URL, a version id) is not supported yet";
            return Err(RemoteError::url(url, why));
        }
        // `s3://bucket` is the bucket's top folder.
        let folder = parsed.path().ends_with('/') || parsed.path().is_empty();
        let (client, retry) = client_options(opts);
        let built = match parsed.scheme() {
            "s3" | "s3a" => s3_store(url, &parsed, opts, client, retry)?,
            "gs" => {
                let store = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
                let bucket = parsed.host_str().unwrap_or_default();
                Built {
                    store: Arc::new(store),
                    path: parsed.path().to_string(),
                    origin: format!("gs://{bucket}"),
                    writer: None,
                }
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let store = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
                let container = parsed.host_str().unwrap_or_default();
                Built {
                    store: Arc::new(store),
                    path: parsed.path().to_string(),
                    origin: format!("{}://{container}", parsed.scheme()),
                    writer: None,
                }
            }
            "http" | "https" => {
                let origin = parsed[..url::Position::BeforePath].to_string();
                let store = object_store::http::HttpBuilder::new()
                    .with_url(&origin)
                    .with_client_options(client.with_allow_http(parsed.scheme() == "http"))
                    .with_retry(retry)
                    .build()
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
                Built {
                    store: Arc::new(store),
                    path: parsed.path().to_string(),
                    origin,
                    writer: None,
                }
            }
            other => {
                return Err(RemoteError::url(
                    url,
                    format!(
                        "unknown scheme {other:?} (s3://, gs://, az://, http:// and https:// are \
                         known)"
                    ),
                ));
            }
        };
        Remote::assemble(url, opts, built, folder)
    }

    /// The connection around a built store: its runtime, the disk cache,
    /// the fetcher with its GETs at once.
    fn assemble(
        url: &str,
        opts: &RemoteOptions,
        built: Built,
        folder: bool,
    ) -> Result<Location, RemoteError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stfs-remote")
            .enable_all()
            .build()
            .map_err(RemoteError::Runtime)?;
        let cache = DiskCache::open(&opts.cache_dir, opts.cache_size)?;
        let path = ObjectPath::from_url_path(built.path.trim_matches('/'))
            .map_err(|e| RemoteError::url(url, e.to_string()))?;
        let concurrency = opts.concurrency.max(1);
        Ok(Location {
            remote: Arc::new(Remote {
                runtime: Some(runtime),
                cache: Arc::new(cache),
                fetcher: Fetcher {
                    store: built.store,
                    gets: Arc::new(tokio::sync::Semaphore::new(concurrency)),
                    timeout: opts.timeout,
                    requests: Arc::new(AtomicU64::new(0)),
                    fetched: Arc::new(AtomicU64::new(0)),
                },
                ahead: Arc::new(AtomicUsize::new(0)),
                // At least one GET slot is left to readers (none ahead with one slot).
                max_ahead: concurrency - (concurrency / 4).max(1),
                origin: built.origin,
                writer: built.writer,
            }),
            path,
            folder,
        })
    }
}

/// A stalled connection fails after `timeout` without data (and is retried
/// within the retry budget); a slow one that keeps sending is waited for,
/// up to ten times as long in all.
fn client_options(opts: &RemoteOptions) -> (ClientOptions, RetryConfig) {
    let client = ClientOptions::new()
        .with_timeout(opts.timeout.saturating_mul(10))
        .with_read_timeout(opts.timeout)
        .with_connect_timeout(opts.timeout.min(Duration::from_secs(10)));
    let retry = RetryConfig {
        max_retries: 3,
        retry_timeout: opts.timeout,
        ..Default::default()
    };
    (client, retry)
}

/// An S3 (or S3-compatible) store, and the writer that commits to it: the
/// environment first, then the shared AWS files, for credentials, region
/// and endpoint.
fn s3_store(
    url: &str,
    parsed: &url::Url,
    opts: &RemoteOptions,
    client: ClientOptions,
    retry: RetryConfig,
) -> Result<Built, RemoteError> {
    let mut b = object_store::aws::AmazonS3Builder::from_env()
        .with_url(url)
        .with_client_options(client.clone())
        .with_retry(retry);
    // The shared files fill in what the environment does not say.
    let profile = super::super::aws_profile::load();
    let unset = |var: &str| std::env::var_os(var).is_none();
    if unset("AWS_ACCESS_KEY_ID") {
        if let (Some(id), Some(secret)) = (profile.access_key_id, profile.secret_access_key) {
            b = b.with_access_key_id(id).with_secret_access_key(secret);
            if let Some(token) = profile.session_token {
                b = b.with_token(token);
            }
        }
    }
    if unset("AWS_REGION") && unset("AWS_DEFAULT_REGION") {
        if let Some(region) = profile.region {
            b = b.with_region(region);
        }
    }
    let endpoint = opts
        .endpoint
        .clone()
        .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
        .or(profile.endpoint_url);
    if let Some(ep) = &endpoint {
        b = b
            .with_allow_http(ep.starts_with("http://"))
            .with_endpoint(ep)
            .with_virtual_hosted_style_request(false);
    }
    let region = b
        .get_config_value(&object_store::aws::AmazonS3ConfigKey::Region)
        .unwrap_or_else(|| "us-east-1".to_string());
    let store = b
        .build()
        .map_err(|e| RemoteError::url(url, e.to_string()))?;
    let bucket = parsed.host_str().unwrap_or_default();
    let http = endpoint.as_ref().is_some_and(|e| e.starts_with("http://"));
    let writer = s3::S3Writer::new(
        store.credentials().clone(),
        &client.with_allow_http(http),
        region,
        bucket.to_string(),
        endpoint,
        opts.timeout,
    )
    .map_err(|e| RemoteError::url(url, e.to_string()))?;
    Ok(Built {
        store: Arc::new(store),
        path: parsed.path().to_string(),
        origin: format!("{}://{bucket}", parsed.scheme()),
        writer: Some(Arc::new(writer)),
    })
}

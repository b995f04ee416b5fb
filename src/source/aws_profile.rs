//! The AWS shared files (`~/.aws/credentials`, `~/.aws/config`), which
//! `object_store` does not read: the profile named by `AWS_PROFILE` (else
//! `default`) gives credentials, region and endpoint where the environment
//! does not (the environment wins, as in the AWS tools).

use std::collections::HashMap;
use std::path::PathBuf;

/// What a profile says; every field is optional.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Profile {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
}

/// Reads the profile from the files the environment (or the defaults) name.
pub fn load() -> Profile {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let file = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(default)))
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    };
    let name = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    from_files(
        &file("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
        &file("AWS_CONFIG_FILE", "config"),
        &name,
    )
}

/// The profile `name` of a credentials file and a config file (where it is
/// `[profile name]`, or `[default]`).
fn from_files(credentials: &str, config: &str, name: &str) -> Profile {
    let creds = sections(credentials);
    let conf = sections(config);
    let conf_name = if name == "default" {
        "default".to_string()
    } else {
        format!("profile {name}")
    };
    let empty = HashMap::new();
    let c = creds.get(name).unwrap_or(&empty);
    let k = conf.get(&conf_name).unwrap_or(&empty);
    let get = |key: &str| c.get(key).or_else(|| k.get(key)).cloned();
    Profile {
        access_key_id: get("aws_access_key_id"),
        secret_access_key: get("aws_secret_access_key"),
        session_token: get("aws_session_token"),
        region: get("region"),
        endpoint_url: get("endpoint_url"),
    }
}

/// `[section]` then `key = value` lines; `#` and `;` start comments.
fn sections(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut current = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = Some(name.trim().to_string());
            continue;
        }
        if let (Some(section), Some((k, v))) = (&current, line.split_once('=')) {
            out.entry(section.clone())
                .or_default()
                .insert(k.trim().to_lowercase(), v.trim().to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_comes_from_both_files() {
        let credentials = "[default]\naws_access_key_id = AKIA1\naws_secret_access_key=s1\n\
                           # comment\n[work]\naws_access_key_id = AKIA2\naws_secret_access_key = s2\n\
                           aws_session_token = t2\n";
        let config = "[default]\nregion = eu-west-1\n[profile work]\nregion=us-east-2\n\
                      endpoint_url = http://127.0.0.1:9000\n";
        let d = from_files(credentials, config, "default");
        assert_eq!(
            (
                d.access_key_id.as_deref(),
                d.secret_access_key.as_deref(),
                d.region.as_deref()
            ),
            (Some("AKIA1"), Some("s1"), Some("eu-west-1"))
        );
        assert_eq!(d.session_token, None);
        let w = from_files(credentials, config, "work");
        assert_eq!(w.session_token.as_deref(), Some("t2"));
        assert_eq!(w.region.as_deref(), Some("us-east-2"));
        assert_eq!(w.endpoint_url.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(from_files("", "", "none"), Profile::default());
    }
}

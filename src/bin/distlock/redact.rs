//! Keeping passwords out of everything the CLI prints.
//!
//! A connection URL may carry a password (`postgres://app:secret@db/app`).
//! The CLI prints URLs in messages and may print driver errors and logs that
//! quote them; everything it writes to the terminal passes through
//! [`Secrets::scrub`] first.

use std::io::{self, Write};
use std::sync::Arc;

/// Text that stands in for a removed password.
const MASK: &str = "***";

/// `url` with the password (in the user info or a `password=` query
/// parameter) replaced by `***`. Text that is not a URL comes back unchanged.
pub(crate) fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return redact_password_params(url);
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    // The user info ends at the last '@' before the query: a raw '@' in a
    // password is common enough, a raw '@' in the host is not possible.
    let query_start = rest.find(['?', '#']).unwrap_or(rest.len());
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..rest_start]);
    match rest[..query_start].rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            match userinfo.split_once(':') {
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push(':');
                    out.push_str(MASK);
                }
                None => out.push_str(userinfo),
            }
            out.push_str(&redact_password_params(&rest[at..]));
        }
        None => out.push_str(&redact_password_params(rest)),
    }
    out
}

/// Replaces the value of every `password=` parameter (URL query or libpq
/// `key=value` text) with `***`.
fn redact_password_params(text: &str) -> String {
    const NEEDLE: &str = "password=";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.to_ascii_lowercase().find(NEEDLE) {
        let value_start = pos + NEEDLE.len();
        out.push_str(&rest[..value_start]);
        out.push_str(MASK);
        let value_len = rest[value_start..]
            .find(['&', ' ', '#', '\'', '"'])
            .unwrap_or(rest.len() - value_start);
        rest = &rest[value_start + value_len..];
    }
    out.push_str(rest);
    out
}

/// The secrets of the URLs in use, to scrub from any text before printing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Secrets {
    passwords: Arc<Vec<String>>,
}

impl Secrets {
    /// Remembers the password of each URL (as written and percent-decoded).
    pub(crate) fn from_urls<'a>(urls: impl IntoIterator<Item = &'a str>) -> Self {
        let mut passwords = Vec::new();
        for url in urls {
            // sqlx's options do not expose the password: read it from the text.
            if let Some(raw) = password_of(url) {
                let decoded = percent_decode(&raw);
                for candidate in [raw, decoded] {
                    if !candidate.is_empty() && !passwords.contains(&candidate) {
                        passwords.push(candidate);
                    }
                }
            }
        }
        // Longest first, so a password containing another is masked whole.
        passwords.sort_by_key(|p| std::cmp::Reverse(p.len()));
        Self {
            passwords: Arc::new(passwords),
        }
    }

    /// `text` with every known password and every URL's password masked.
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for password in self.passwords.iter() {
            out = out.replace(password.as_str(), MASK);
        }
        if out.contains("://") || out.to_ascii_lowercase().contains("password=") {
            out = out
                .split_inclusive(char::is_whitespace)
                .map(|token| {
                    if token.contains("://") || token.to_ascii_lowercase().contains("password=") {
                        redact_url(token)
                    } else {
                        token.to_owned()
                    }
                })
                .collect();
        }
        out
    }
}

/// The password in a URL's user info, or in a `password=` parameter.
fn password_of(url: &str) -> Option<String> {
    let rest = &url[url.find("://")? + 3..];
    let query_start = rest.find(['?', '#']).unwrap_or(rest.len());
    let from_userinfo = rest[..query_start]
        .rfind('@')
        .and_then(|at| rest[..at].split_once(':'))
        .map(|(_, password)| password.to_owned());
    from_userinfo.or_else(|| {
        let query = &rest[query_start..];
        let start = query.to_ascii_lowercase().find("password=")? + "password=".len();
        let value = &query[start..];
        Some(value[..value.find(['&', '#']).unwrap_or(value.len())].to_owned())
    })
}

/// Decodes `%XX` escapes (invalid escapes are kept as they are).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = text.get(i + 1..i + 3)
            && let Ok(byte) = u8::from_str_radix(hex, 16)
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `tracing` writer that scrubs secrets from every log line.
#[derive(Debug, Clone)]
pub(crate) struct ScrubbingStderr {
    secrets: Secrets,
}

impl ScrubbingStderr {
    pub(crate) fn new(secrets: Secrets) -> Self {
        Self { secrets }
    }
}

impl Write for ScrubbingStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // The fmt layer writes one formatted event per call.
        let clean = self.secrets.scrub(&String::from_utf8_lossy(buf));
        io::stderr().write_all(clean.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ScrubbingStderr {
    type Writer = ScrubbingStderr;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_password() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db.example:5432/app"),
            "postgres://app:***@db.example:5432/app"
        );
        assert_eq!(
            redact_url("postgres://app:p@ss:w@rd@db/app?sslmode=require"),
            "postgres://app:***@db/app?sslmode=require"
        );
        assert_eq!(
            redact_url("postgres://app@db/app?password=hunter2&sslmode=disable"),
            "postgres://app@db/app?password=***&sslmode=disable"
        );
        assert_eq!(redact_url("postgres://db/app"), "postgres://db/app");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn scrub_removes_known_passwords_anywhere() {
        let secrets = Secrets::from_urls(["postgres://app:s%40cret@db/app"]);
        let text = "failed: s@cret and s%40cret, see postgres://other:pw@h/x";
        let clean = secrets.scrub(text);
        assert!(!clean.contains("s@cret"), "{clean}");
        assert!(!clean.contains("s%40cret"), "{clean}");
        assert!(!clean.contains(":pw@"), "{clean}");
        assert!(clean.contains("postgres://other:***@h/x"), "{clean}");
    }

    #[test]
    fn libpq_style_password_parameters_are_masked() {
        let secrets = Secrets::default();
        assert_eq!(
            secrets.scrub("host=db password=hunter2 user=app"),
            "host=db password=*** user=app"
        );
    }
}

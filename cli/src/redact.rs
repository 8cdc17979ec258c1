//! Keeping passwords out of everything the CLI prints.
//!
//! A connection URL may carry a password (`postgres://app:secret@db/app`).
//! The CLI prints URLs in messages and may print driver errors and logs that
//! quote them; everything it writes to the terminal passes through
//! [`Secrets::scrub`] first.

use std::io::{self, Write};
use std::sync::Arc;

use url::Url;

/// Text that stands in for a removed password.
const MASK: &str = "***";

/// `text` with the password of the URL in it (in the user info or a
/// `password=` query parameter) replaced by `***`. Text around the URL (such
/// as an opening parenthesis) is kept; text that is not a URL comes back
/// unchanged, `password=` parameters aside.
pub(crate) fn redact_url(text: &str) -> String {
    let Some(url_start) = url_start(text) else {
        return redact_password_params(text);
    };
    let (before, url) = text.split_at(url_start);
    let mut out = String::with_capacity(text.len());
    out.push_str(before);
    out.push_str(&redact_password_params(&mask_password(url)));
    out
}

/// Where the URL in `text` starts: at the scheme before the first `://`.
fn url_start(text: &str) -> Option<usize> {
    let separator = text.find("://")?;
    let scheme_len = text[..separator]
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        .count();
    // Scheme characters are ASCII: one byte each.
    Some(separator - scheme_len)
}

/// `url` parsed the way the database and Redis drivers parse it, unless the
/// parse looks wrong: a password holding `/`, `?` or `#` can make a parser
/// end the user info early (`app:123/x@db` reads as host `app`, port 123),
/// which leaves an `@` in the path, query or fragment.
fn parse(url: &str) -> Option<Url> {
    // The parser drops spaces at the ends and tabs and newlines anywhere,
    // which a masked copy must keep.
    if url.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return None;
    }
    let parsed = Url::parse(url).ok()?;
    let has_at = |part: Option<&str>| part.is_some_and(|part| part.contains('@'));
    let suspicious =
        has_at(Some(parsed.path())) || has_at(parsed.query()) || has_at(parsed.fragment());
    (!suspicious).then_some(parsed)
}

/// `url` (starting at its scheme) with the password of its user info masked.
fn mask_password(url: &str) -> String {
    let Some(mut parsed) = parse(url) else {
        return mask_password_by_text(url);
    };
    if parsed.password().is_none_or(str::is_empty) {
        return url.to_owned();
    }
    match parsed.set_password(Some(MASK)) {
        Ok(()) => parsed.to_string(),
        Err(()) => mask_password_by_text(url),
    }
}

/// The user info of a URL that does not parse: everything between `://` and
/// the last `@` (a password may hold any character, a host no `@`), split
/// into the user name and the password at the first `:`.
fn user_info_by_text(url: &str) -> Option<(usize, &str, &str)> {
    let start = url.find("://")? + 3;
    let end = start + url[start..].rfind('@')?;
    let (user, password) = url[start..end].split_once(':')?;
    Some((start, user, password))
}

/// Whether the user info of `url` (as written) holds a character that ends
/// it for a URL parser (`#`, `?`, `/`): such a password must be
/// percent-encoded.
pub(crate) fn user_info_needs_encoding(url: &str) -> bool {
    let start = url_start(url).unwrap_or(0);
    user_info_by_text(&url[start..]).is_some_and(|(_, user, password)| {
        [user, password]
            .iter()
            .any(|part| part.contains(['#', '?', '/']))
    })
}

/// Whether `url` reads as a user name or password cut short by an
/// unencoded `#`, `?` or `/`: its user info as written holds one, and a URL
/// parser puts the rest of it where no URL has an `@` (the path, the
/// fragment, or the name of a query parameter: `app:?secret@db` parses as
/// host `app` and a parameter named `secret@db`). An `@` in a parameter's
/// value (`?user=svc@tenant`) is a URL's own. A URL that does not parse at
/// all is refused by its parser.
pub(crate) fn user_info_cut_short(url: &str) -> bool {
    if !user_info_needs_encoding(url) {
        return false;
    }
    let start = url_start(url).unwrap_or(0);
    let Ok(parsed) = Url::parse(&url[start..]) else {
        return false;
    };
    let in_name = |query: &str| {
        query.split('&').any(|pair| {
            pair.split('=')
                .next()
                .is_some_and(|name| name.contains('@'))
        })
    };
    parsed.path().contains('@')
        || parsed.fragment().is_some_and(|f| f.contains('@'))
        || parsed.query().is_some_and(in_name)
}

/// `url`, which does not parse, with everything after the user name in its
/// user info masked.
fn mask_password_by_text(url: &str) -> String {
    let Some((start, user, password)) = user_info_by_text(url) else {
        return url.to_owned();
    };
    let rest = start + user.len() + 1 + password.len();
    format!("{}{user}:{MASK}{}", &url[..start], &url[rest..])
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
    /// Passwords to mask wherever they appear, longest first.
    passwords: Arc<Vec<String>>,
}

impl Secrets {
    /// Remembers the password of each URL (as written and percent-decoded).
    ///
    /// A password that also shows in its URL once masked (equal to the user
    /// name, the database name, the scheme...) is not masked everywhere:
    /// that would mask those words too and tell which word the password is.
    /// It is still masked in every URL.
    pub(crate) fn from_urls<'a>(urls: impl IntoIterator<Item = &'a str>) -> Self {
        let mut passwords = Vec::new();
        for url in urls {
            let shown = redact_url(url);
            for raw in passwords_of(url) {
                let decoded = percent_decode(&raw);
                for candidate in [raw, decoded] {
                    if !candidate.is_empty()
                        && !shown.contains(&candidate)
                        && !passwords.contains(&candidate)
                    {
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

    /// `text` with every URL's password and every known password masked.
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        if out.contains("://") || out.to_ascii_lowercase().contains("password=") {
            out = out
                .split_inclusive(char::is_whitespace)
                .map(|token| {
                    if token.contains("://") || token.to_ascii_lowercase().contains("password=") {
                        let word = token.trim_end();
                        redact_url(word) + &token[word.len()..]
                    } else {
                        token.to_owned()
                    }
                })
                .collect();
        }
        for password in self.passwords.iter() {
            out = out.replace(password.as_str(), MASK);
        }
        out
    }
}

/// The passwords in a URL's user info (as the drivers read it, or as the
/// text shows it when it does not parse) and `password=` parameters.
fn passwords_of(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    if let Some(start) = url_start(text) {
        let url = &text[start..];
        match parse(url) {
            Some(parsed) => found.extend(parsed.password().map(str::to_owned)),
            None => found.extend(user_info_by_text(url).map(|(_, _, p)| p.to_owned())),
        }
    }
    let lower = text.to_ascii_lowercase();
    let mut rest = 0;
    while let Some(pos) = lower[rest..].find("password=") {
        let start = rest + pos + "password=".len();
        let len = text[start..]
            .find(['&', '#', ' ', '\'', '"'])
            .unwrap_or(text.len() - start);
        found.push(text[start..start + len].to_owned());
        rest = start + len;
    }
    found
}

/// Decodes `%XX` escapes (invalid escapes are kept as they are).
fn percent_decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
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
        // The fmt layer writes one formatted event per call. A line that
        // cannot be written is dropped: tracing reports a writer's error
        // with `eprintln!`, which would panic on the same closed stderr.
        let clean = self.secrets.scrub(&String::from_utf8_lossy(buf));
        let _ = io::stderr().write_all(clean.as_bytes());
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
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
    fn url_delimiters_in_a_password_are_masked_with_it() {
        for (url, masked) in [
            ("postgres://app:pa#ss@db/app", "postgres://app:***@db/app"),
            ("postgres://app:pa?ss@db/app", "postgres://app:***@db/app"),
            ("postgres://app:pa/ss@db/app", "postgres://app:***@db/app"),
            ("postgres://app:pa@ss@db/app", "postgres://app:***@db/app"),
            (
                "postgres://app:p#a?s/s@w@db:5432/app?sslmode=require",
                "postgres://app:***@db:5432/app?sslmode=require",
            ),
            // A password that parses as a port: the path holds an '@'.
            ("postgres://app:123/x@db/app", "postgres://app:***@db/app"),
            ("postgres://app:pa%23ss@db/app", "postgres://app:***@db/app"),
            ("postgres://app:100%@db/app", "postgres://app:***@db/app"),
        ] {
            assert_eq!(redact_url(url), masked, "{url}");
        }
    }

    #[test]
    fn delimiters_in_a_password_never_reach_the_output() {
        for password in [
            "pa#ss-x1",
            "pa?ss-x1",
            "pa/ss-x1",
            "pa@ss-x1",
            "pa%ss-x1",
            "pa%23ss-x1",
        ] {
            let url = format!("postgres://app:{password}@db:5432/app");
            let secrets = Secrets::from_urls([url.as_str()]);
            let text = format!("invalid database URL {url}: invalid port number; also {password}");
            let clean = secrets.scrub(&text);
            assert!(!clean.contains("ss-x1"), "{password}: {clean}");
            assert!(clean.contains("postgres://app:***@db:5432/app"), "{clean}");
        }
    }

    #[test]
    fn a_password_that_is_also_a_word_of_the_url_masks_only_the_password() {
        for url in [
            "postgres://postgres:postgres@db/postgres",
            "postgres://app:app@db/app",
            "postgres://app:db@db/app",
            "postgres://app:app_db@db/app_db",
        ] {
            let secrets = Secrets::from_urls([url]);
            let expected = redact_url(url);
            assert!(expected.contains(":***@"), "{expected}");
            assert_eq!(
                secrets.scrub(&format!("could not connect to {url}: no")),
                format!("could not connect to {expected}: no")
            );
        }
        assert_eq!(
            redact_url("postgres://postgres:postgres@db/postgres"),
            "postgres://postgres:***@db/postgres"
        );
    }

    #[test]
    fn urls_without_a_password_stay_as_they_are() {
        for url in [
            "postgres://app@db/app",
            "postgres://db:5432/app?sslmode=require",
            "redis://127.0.0.1:6379",
            "redis://127.0.0.1:6379/0",
        ] {
            assert_eq!(redact_url(url), url);
            assert_eq!(Secrets::from_urls([url]).scrub(url), url);
        }
    }

    #[test]
    fn text_that_does_not_parse_loses_only_its_user_info_password() {
        // Not URLs a parser accepts, but the user info is still found.
        assert_eq!(
            redact_url("postgres://app:pa ss@db/app"),
            "postgres://app:pa ss@db/app".replace("pa ss", "***")
        );
        assert_eq!(
            redact_url("postgres://app:s3cret@[not-a-host/app"),
            "postgres://app:***@[not-a-host/app"
        );
        assert_eq!(
            redact_url("(see postgres://app:s3cret@db:99999/app)"),
            "(see postgres://app:***@db:99999/app)"
        );
        assert_eq!(redact_url("://app:s3cret@db"), "://app:***@db");
        assert_eq!(redact_url("plain text"), "plain text");
    }

    #[test]
    fn a_password_that_ends_the_user_info_is_detected() {
        assert!(user_info_needs_encoding("postgres://app:pa#ss@db/app"));
        assert!(user_info_needs_encoding("postgres://app:pa?ss@db/app"));
        assert!(user_info_needs_encoding("postgres://app:pa/ss@db/app"));
        assert!(!user_info_needs_encoding("postgres://app:pa%23ss@db/app"));
        assert!(!user_info_needs_encoding("postgres://app:p@ss@db/app"));
        assert!(!user_info_needs_encoding("postgres://db/app?x=1#y"));
    }

    /// Cut short where the rest of the password lands where no URL has an
    /// `@`; an `@` in a parameter's value is the URL's own.
    #[test]
    fn a_password_cut_short_is_told_from_an_at_in_a_parameter_value() {
        for cut in [
            "postgres://app:?secret@db/app",
            "postgres://app:2024?Summer@db/app",
            "postgres://app:#secret@db/app",
            "postgres://app:99/secret@db/app",
        ] {
            assert!(user_info_cut_short(cut), "{cut}");
        }
        for whole in [
            "postgres://db:5432/app?user=svc@tenant",
            "postgres://u:p@db/app?application_name=a@b",
            "postgres://app:p%3Fss@db/app",
            "postgres://db/app",
        ] {
            assert!(!user_info_cut_short(whole), "{whole}");
        }
    }

    #[test]
    fn redis_urls_lose_their_password() {
        assert_eq!(redact_url("redis://:secret@host"), "redis://:***@host");
        assert_eq!(
            redact_url("redis://default:secret@host:6380/2"),
            "redis://default:***@host:6380/2"
        );
        assert_eq!(redact_url("rediss://:se#cret@host"), "rediss://:***@host");
        let secrets = Secrets::from_urls(["redis://:se#cret@host"]);
        let clean = secrets.scrub("connection to redis://:se#cret@host refused (se#cret)");
        assert!(!clean.contains("se#cret"), "{clean}");
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

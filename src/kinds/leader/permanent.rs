//! Which errors end a campaign (or an observer) and reach the caller, and
//! which are retried.

use crate::Error;

/// A copy of `err` if no retry can cure it (the campaign then ends), `None`
/// for errors that may pass (a server down or unreachable, a timeout, a
/// lost lock). These variants carry only plain data, so they can be copied
/// for [`Campaign::failure`](crate::Campaign::failure), `resign` and every
/// handle's `elected`.
pub(super) fn permanent(err: &Error) -> Option<Error> {
    Some(match err {
        Error::InvalidKey { key, reason } => Error::InvalidKey {
            key: key.clone(),
            reason,
        },
        Error::InvalidArgument { argument, reason } => Error::InvalidArgument {
            argument,
            reason: reason.clone(),
        },
        Error::InvalidSetting {
            setting,
            value,
            allowed,
        } => Error::InvalidSetting {
            setting,
            value: value.clone(),
            allowed: allowed.clone(),
        },
        Error::NoRuntime(what) => Error::NoRuntime(what),
        // `migrate` was not run: fencing tokens and the leader record need
        // its schema.
        Error::NotMigrated { message } => Error::NotMigrated {
            message: message.clone(),
        },
        // A missing grant (the leader record's table, say): only an
        // administrator can cure it.
        Error::PermissionDenied { message } => Error::PermissionDenied {
            message: message.clone(),
        },
        Error::UntrustedSchema { schema, owner } => Error::UntrustedSchema {
            schema: schema.clone(),
            owner: owner.clone(),
        },
        // A transaction pooler in front is how the deployment is built; a
        // session lock cannot be held through it, ever.
        Error::PoolerDetected { evidence } => Error::PoolerDetected {
            evidence: evidence.clone(),
        },
        Error::Unsupported { what, backend } => Error::Unsupported { what, backend },
        Error::CampaignEnded { key } => Error::CampaignEnded { key: key.clone() },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolerEvidence;

    #[test]
    fn configuration_and_setup_errors_are_permanent_and_outages_are_not() {
        let permanent_ones = [
            Error::InvalidKey {
                key: "".into(),
                reason: "empty",
            },
            Error::InvalidArgument {
                argument: "x",
                reason: "out of range".into(),
            },
            Error::InvalidSetting {
                setting: "wait",
                value: "0ns".into(),
                allowed: "at least 10ms".into(),
            },
            Error::NoRuntime("campaign"),
            Error::NotMigrated {
                message: "schema \"distlock\" does not exist".into(),
            },
            Error::PermissionDenied {
                message: "permission denied for table leaders".into(),
            },
            Error::UntrustedSchema {
                schema: "distlock".into(),
                owner: "mallory".into(),
            },
            Error::PoolerDetected {
                evidence: PoolerEvidence::BackendChanged { from: 1, to: 2 },
            },
            Error::Unsupported {
                what: "leader()",
                backend: "redis",
            },
        ];
        for err in &permanent_ones {
            let copy = permanent(err).unwrap_or_else(|| panic!("{err:?} is permanent"));
            assert_eq!(copy.to_string(), err.to_string());
        }
        let passing = [
            Error::Timeout {
                key: "k".into(),
                waited: std::time::Duration::from_secs(1),
                holder_pid: None,
                holder_application: None,
                chain: Default::default(),
            },
            Error::Database(sqlx::Error::PoolTimedOut),
            Error::LockLost {
                key: "k".into(),
                reason: crate::LossReason::Expired,
            },
        ];
        for err in &passing {
            assert!(permanent(err).is_none(), "{err:?} may pass");
        }
    }
}

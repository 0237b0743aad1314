//! Function validation, shared by the router and the controller.
//!
//! The first six rules and their messages are the wire contract (routers and
//! operators match on them). The name-format rules come after them: a name
//! Kubernetes cannot store as a label value or object name is rejected here
//! instead of failing later at the API server.

use super::Function;

/// Why a function is not acceptable. `Display` is the one-line message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("missing namespace")]
    MissingNamespace,
    #[error("missing deployment")]
    MissingDeployment,
    #[error("missing tenant")]
    MissingTenant,
    #[error("missing scale")]
    MissingScale,
    #[error("scale.max_instances must be >= 1")]
    MaxInstancesZero,
    #[error("scale.min_instances ({min}) must be <= scale.max_instances ({max})")]
    MinAboveMax { min: u32, max: u32 },
    #[error(
        "invalid namespace {0:?}: must be a DNS-1123 label (at most 63 lowercase alphanumerics or '-', starting and ending with an alphanumeric)"
    )]
    InvalidNamespace(String),
    #[error(
        "invalid deployment {0:?}: must be a DNS-1123 subdomain of at most 63 characters (lowercase alphanumerics, '-' or '.', starting and ending with an alphanumeric)"
    )]
    InvalidDeployment(String),
    #[error(
        "invalid tenant {0:?}: must be a Kubernetes label value (at most 63 alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric)"
    )]
    InvalidTenant(String),
}

impl Function {
    /// Checks the function, returning the first rule it breaks.
    ///
    /// # Errors
    /// See [`ValidationError`] for the rules, in the order they are checked.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.check_present()?;
        let Some(scale) = &self.scale else {
            return Err(ValidationError::MissingScale);
        };
        let (min, max) = (scale.min_instances(), scale.max_instances());
        if max < 1 {
            return Err(ValidationError::MaxInstancesZero);
        }
        if min > max {
            return Err(ValidationError::MinAboveMax { min, max });
        }
        self.check_names()
    }

    /// Checks what names the function — namespace, deployment and tenant,
    /// in [`Function::validate`]'s order — and not its `scale`: enough to
    /// find its owner on the ring.
    ///
    /// # Errors
    /// The first rule of [`ValidationError`] about names that it breaks.
    pub fn validate_identity(&self) -> Result<(), ValidationError> {
        self.check_present()?;
        self.check_names()
    }

    fn check_present(&self) -> Result<(), ValidationError> {
        if self.namespace.is_empty() {
            return Err(ValidationError::MissingNamespace);
        }
        if self.deployment.is_empty() {
            return Err(ValidationError::MissingDeployment);
        }
        if self.tenant.is_empty() {
            return Err(ValidationError::MissingTenant);
        }
        Ok(())
    }

    fn check_names(&self) -> Result<(), ValidationError> {
        if !is_dns1123_label(&self.namespace) {
            return Err(ValidationError::InvalidNamespace(self.namespace.clone()));
        }
        if !is_dns1123_subdomain(&self.deployment) || self.deployment.len() > 63 {
            return Err(ValidationError::InvalidDeployment(self.deployment.clone()));
        }
        if !is_label_value(&self.tenant) {
            return Err(ValidationError::InvalidTenant(self.tenant.clone()));
        }
        Ok(())
    }
}

fn alnum_lower(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// RFC 1123 label: 1–63 of `[a-z0-9-]`, starting and ending alphanumeric.
#[must_use]
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && alnum_lower(b[0])
        && alnum_lower(b[b.len() - 1])
        && b.iter().all(|&c| alnum_lower(c) || c == b'-')
}

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters.
#[must_use]
pub fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// Kubernetes label value: at most 63 of `[A-Za-z0-9-_.]`, starting and ending
/// alphanumeric (the empty value is also valid).
#[must_use]
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() {
        return true;
    }
    b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Scale;

    fn valid() -> Function {
        Function {
            namespace: "ns".into(),
            deployment: "dep".into(),
            tenant: "tenant-1".into(),
            scale: Some(Scale {
                max_instances: Some(1),
                ..Scale::default()
            }),
            ..Function::default()
        }
    }

    #[test]
    fn rules_in_order_with_exact_messages() {
        type Mutation = Box<dyn Fn(&mut Function)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|f| f.namespace.clear()), "missing namespace"),
            (
                Box::new(|f| {
                    f.namespace.clear();
                    f.tenant.clear()
                }),
                "missing namespace",
            ),
            (Box::new(|f| f.deployment.clear()), "missing deployment"),
            (Box::new(|f| f.tenant.clear()), "missing tenant"),
            (Box::new(|f| f.scale = None), "missing scale"),
            (
                Box::new(|f| f.scale = Some(Scale::default())),
                "scale.max_instances must be >= 1",
            ),
            (
                Box::new(|f| {
                    f.scale = Some(Scale {
                        min_instances: Some(3),
                        max_instances: Some(2),
                        ..Scale::default()
                    })
                }),
                "scale.min_instances (3) must be <= scale.max_instances (2)",
            ),
            (
                Box::new(|f| {
                    f.scale = None;
                    f.tenant = "bad tenant".into()
                }),
                "missing scale",
            ),
        ];
        for (mutate, want) in cases {
            let mut f = valid();
            mutate(&mut f);
            assert_eq!(f.validate().unwrap_err().to_string(), want);
        }
        assert_eq!(valid().validate(), Ok(()));
    }

    #[test]
    fn identity_needs_names_but_no_scale() {
        let mut f = valid();
        f.scale = None;
        assert_eq!(f.validate_identity(), Ok(()));
        f.scale = Some(Scale::default());
        assert_eq!(f.validate_identity(), Ok(()), "scale rules do not apply");
        f.tenant.clear();
        assert_eq!(f.validate_identity(), Err(ValidationError::MissingTenant));
        f.tenant = "bad tenant".into();
        assert!(matches!(
            f.validate_identity(),
            Err(ValidationError::InvalidTenant(_))
        ));
    }

    #[test]
    fn names_must_be_storable_by_kubernetes() {
        let mut f = valid();
        f.tenant = "x".repeat(64);
        assert!(matches!(f.validate(), Err(ValidationError::InvalidTenant(_))));
        for t in ["a b", "-a", "a-", "a\"b", "é"] {
            f.tenant = t.into();
            assert!(
                f.validate()
                    .unwrap_err()
                    .to_string()
                    .starts_with("invalid tenant"),
                "{t}"
            );
        }
        for t in ["A", "a_b.c-D", &"x".repeat(63)] {
            f.tenant = t.to_string();
            assert_eq!(f.validate(), Ok(()), "{t}");
        }
        let mut f = valid();
        f.namespace = "Prod".into();
        assert!(
            f.validate()
                .unwrap_err()
                .to_string()
                .starts_with("invalid namespace \"Prod\"")
        );
        let mut f = valid();
        f.deployment = "my.app".into();
        assert_eq!(f.validate(), Ok(()));
        f.deployment = "my_app".into();
        assert!(matches!(
            f.validate_identity(),
            Err(ValidationError::InvalidDeployment(_))
        ));
        f.deployment = "my.app".into();
        f.deployment = "my_app".into();
        assert!(
            f.validate()
                .unwrap_err()
                .to_string()
                .starts_with("invalid deployment")
        );
    }
}

package dev.streamtally.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.context.ApplicationScoped;
import javax.enterprise.inject.Produces;

/**
 * The list of run-time changeable properties that Apicurio's config-index
 * Quarkus extension would build; that extension's deployment half is not on
 * Maven Central, so the local registry has none: every property keeps the
 * value the command line gives it.
 */
public class DynamicPropertiesProducer {

    @Produces
    @ApplicationScoped
    DynamicConfigPropertyList dynamicConfigPropertyList() {
        return new DynamicConfigPropertyList(List.of());
    }
}

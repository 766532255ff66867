from django.contrib import admin

from models_registry.models import ModelDefinition, Placement


class PlacementInline(admin.TabularInline):
    model = Placement
    extra = 0


@admin.register(ModelDefinition)
class ModelDefinitionAdmin(admin.ModelAdmin):
    list_display = ("served_name", "runtime", "delivery", "desired_state")
    inlines = [PlacementInline]
